"""Serving SharpDraft through Triton Inference Server: the request/response contract
(protocol.py), the model repository generator (repository.py), the Python-backend model
copied into every repository (model.py), the server launcher (server.py), and `serve`
itself as a child process on free loopback ports (launch.py: the serving tests and scripts)."""
