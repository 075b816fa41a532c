"""Triton Python-backend model: one SharpDraft engine per instance. The streaming
(decoupled) model batches in flight: requests join a running batch at step boundaries
(runtime/serve/scheduler.py, up to the max_batch parameter, max_queue waiting) and stream
their own tokens; the plain model runs one `generate` per request. Copied verbatim into each generated repository as <model>/1/model.py
by runtime/serve/repository.py; everything it needs to know comes from config.pbtxt."""

import json
import os
import sys

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        params = {k: v["string_value"] for k, v in config.get("parameters", {}).items()}
        # The repository points back at the checkout that wrote it (paths relative to this
        # model's directory), so a server started by hand (not through `serve --start`)
        # still finds the runtime package, and a moved checkout still serves.
        model_dir = args["model_repository"]
        repo_root = os.path.normpath(os.path.join(model_dir, params["repo_root"]))
        engine_dir = os.path.normpath(os.path.join(model_dir, params["engine_dir"]))
        if repo_root not in sys.path:
            sys.path.insert(0, repo_root)
        os.environ["HF_HUB_OFFLINE"] = "1"  # offline by construction: never touch a hub
        import torch

        # Instances are separate processes on the same cores: share the cores out rather
        # than let every instance start one thread per core and contend.
        instances = sum(int(g.get("count", 1)) for g in config.get("instance_group", [])) or 1
        threads = params.get("threads", "auto")
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // instances)
                              if threads == "auto" else int(threads))

        from runtime.engine import Engine
        from runtime.serve import protocol
        from runtime.streaming import TextStream

        self.protocol, self.TextStream = protocol, TextStream
        self.limit = int(params["max_new_tokens_limit"])
        self.decoupled = pb_utils.using_decoupled_model_transaction_policy(config)
        self.engine = Engine(engine_dir, backend=params.get("backend") or None)
        self.scheduler = None
        max_batch = int(params.get("max_batch", "1"))
        if self.decoupled and max_batch > 1:
            from runtime.serve.scheduler import Cancelled, Job, QueueFull, StepScheduler

            self.Cancelled, self.Job, self.QueueFull = Cancelled, Job, QueueFull
            self.scheduler = StepScheduler(self.engine, max_batch, int(params.get("max_queue", "64")))
        pb_utils.Logger.log_info(f"{args['model_instance_name']}: engine {engine_dir} "
                                 f"loaded, {torch.get_num_threads()} torch thread(s), "
                                 f"{'streaming' if self.decoupled else 'one response per request'}"
                                 + (f", in-flight batches of up to {max_batch}" if self.scheduler else ""))

    def execute(self, requests):
        if self.decoupled:
            for request in requests:
                (self._submit if self.scheduler else self._stream)(request)
            return None
        return [self._respond(request) for request in requests]

    def _arrays(self, request):
        arrays = {}
        for spec in self.protocol.INPUTS:
            tensor = pb_utils.get_input_tensor_by_name(request, spec.name)
            arrays[spec.name] = None if tensor is None else tensor.as_numpy()
        return arrays

    def _prepare(self, request):
        # The generate endpoint turns JSON fields that name no input into request
        # parameters; parse() refuses them so a misspelt field is an error, not ignored.
        parameters = json.loads(request.parameters() or "{}")
        req = self.protocol.parse(self._arrays(request), self.limit, parameters)
        ids = self.protocol.encode_prompt(self.engine, req)
        req.mode(self.engine)  # a mode this engine cannot run: refused before any work
        return req, ids

    def _error(self, exc):
        if isinstance(exc, self.protocol.RequestError):
            return pb_utils.TritonError(str(exc), pb_utils.TritonError.INVALID_ARG)
        # A bug, not the request: the details (paths, internals) stay in the server log.
        reply, log = self.protocol.internal_error(exc)
        pb_utils.Logger.log_error(log)
        return pb_utils.TritonError(reply, pb_utils.TritonError.INTERNAL)

    def _tensors(self, arrays):
        return [pb_utils.Tensor(name, value) for name, value in arrays.items()]

    def _respond(self, request):
        try:
            req, ids = self._prepare(request)
            gen = self.engine.generate(ids, req.max_new_tokens, req.mode(self.engine),
                                       req.sampling())
            arrays = self.protocol.outputs(self.engine.decode(gen.tokens), gen.tokens, gen,
                                           self.protocol.finish_reason(gen))
            return pb_utils.InferenceResponse(output_tensors=self._tensors(arrays))
        except Exception as exc:  # one bad request must not take the instance down
            return pb_utils.InferenceResponse(error=self._error(exc))

    def _open_stream(self, request, cancelled):
        """What both streaming paths share: parse the request (on bad input an error
        response ends the stream and this returns None), then callbacks that send each
        commit's token_ids and text (raising `cancelled` once the client has gone, so the
        instance stops spending steps on it), the final response with the generation's
        statistics (and any text held back mid-character), or an error."""
        sender = request.get_response_sender()
        final = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL

        def fail(exc):
            sender.send(pb_utils.InferenceResponse(error=self._error(exc)), flags=final)

        try:
            req, ids = self._prepare(request)
        except Exception as exc:
            fail(exc)
            return None
        text = self.TextStream(self.engine.decode)

        def on_tokens(new):
            if request.is_cancelled():
                raise cancelled()
            arrays = {"text": self.protocol.text_array(text.push(new)),
                      "token_ids": self.protocol.ids_array(new)}
            sender.send(pb_utils.InferenceResponse(output_tensors=self._tensors(arrays)))

        def on_done(gen):
            arrays = self.protocol.outputs(text.flush(), [], gen, self.protocol.finish_reason(gen))
            sender.send(pb_utils.InferenceResponse(output_tensors=self._tensors(arrays)), flags=final)

        def on_error(exc):
            if isinstance(exc, cancelled):
                sender.send(flags=final)
            else:
                fail(exc)

        return req, ids, on_tokens, on_done, on_error, sender

    def _stream(self, request):
        """One response per commit -- the prefill's first token, then each verify step --
        and a last one, flagged final, with the statistics; decoded here, one request at a
        time."""
        opened = self._open_stream(request, _Cancelled)
        if opened is None:
            return
        req, ids, on_tokens, on_done, on_error, _ = opened
        try:
            gen = self.engine.generate(ids, req.max_new_tokens,
                                       req.mode(self.engine), req.sampling(),
                                       on_tokens=on_tokens)
        except Exception as exc:
            on_error(exc)
            return
        on_done(gen)

    def _submit(self, request):
        """Like _stream, but the request joins the scheduler's running batch: execute()
        returns at once and the scheduler's thread sends each step's tokens and the end."""
        opened = self._open_stream(request, self.Cancelled)
        if opened is None:
            return
        req, ids, on_tokens, on_done, send_error, sender = opened

        def on_error(exc):
            if isinstance(exc, ValueError) and not isinstance(exc, self.protocol.RequestError):
                exc = self.protocol.RequestError(str(exc))  # the request's own input
            send_error(exc)

        try:
            self.scheduler.submit(self.Job(ids, req.max_new_tokens, req.mode(self.engine),
                                           req.sampling(), on_tokens, on_done, on_error))
        except self.QueueFull as exc:
            error = pb_utils.TritonError(str(exc), getattr(pb_utils.TritonError, "UNAVAILABLE",
                                                           pb_utils.TritonError.INTERNAL))
            sender.send(pb_utils.InferenceResponse(error=error),
                        flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    def finalize(self):
        if self.scheduler is not None:
            self.scheduler.close()
        self.engine = None


class _Cancelled(Exception):
    pass
