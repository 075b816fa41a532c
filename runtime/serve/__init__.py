"""Serving SharpDraft through Triton Inference Server: the request/response contract
(protocol.py), the model repository generator (repository.py), the Python-backend model
copied into every repository (model.py), and the server launcher (server.py)."""
