"""Serving: `tfm serve`, the HTTP API over the decoding wing's engines.

server.py is the FastAPI app: request models and limits, the batcher that groups requests for the
engine, health, signals and shutdown.

Entry points: `server.serve`, `server.create_app`.
May import: every wing before it (model, runtime, experiment, data, interop, decoding, training).
"""
