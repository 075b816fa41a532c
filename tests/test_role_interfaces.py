"""The roles are code (runtime/backends/roles.py): abstract classes the backends subclass,
so a backend missing a method fails where it is defined, not mid-decode."""

import inspect

from runtime.backends import roles


def test_every_backend_role_subclasses_its_interface():
    from runtime.backends import tensorrt_plans
    from runtime.backends.onnxruntime import drafters as onnx_drafters
    from runtime.backends.onnxruntime.loader import OnnxEngine
    from runtime.backends.onnxruntime.target import OnnxBatchTarget
    from runtime.backends.pytorch import eager
    from runtime.backends.pytorch.loader import TorchLoaded

    expected = {
        roles.BatchTarget: [eager.TorchBatchTarget, OnnxBatchTarget, tensorrt_plans.TensorRTTarget],
        roles.BatchBlockDrafter: [eager.TorchBatchDFlash, onnx_drafters.OnnxBatchDFlash,
                                  onnx_drafters.BoundBatchDFlash, tensorrt_plans.TensorRTDFlash],
        roles.BatchChainDrafter: [eager.TorchBatchPARD, eager.TorchBatchEagle3,
                                  onnx_drafters.OnnxBatchPARD, onnx_drafters.OnnxBatchEagle3],
        roles.BatchTreeDrafter: [eager.TorchBatchEagle3, onnx_drafters.OnnxBatchEagle3],
        roles.Loaded: [TorchLoaded, OnnxEngine, tensorrt_plans.TensorRTEngine],
    }
    for interface, classes in expected.items():
        assert inspect.isabstract(interface)
        for cls in classes:
            assert issubclass(cls, interface) and not inspect.isabstract(cls), (interface, cls)


def test_an_incomplete_role_cannot_be_made():
    class Half(roles.BatchChainDrafter):  # no draft()
        def add(self, capacity, part, more):
            pass

        def remove(self, row):
            pass

    assert inspect.isabstract(Half) and "draft" in Half.__abstractmethods__
