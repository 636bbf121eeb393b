"""Serving: `tfm serve`, the HTTP API over the decoding wing's engines.

server.py is the FastAPI app (its endpoints, signals and shutdown); requests.py what a request may
ask and how it is checked and answered; batcher.py the dynamic batching that groups requests for the
engine, in fair share between clients; transport.py the connection's own limits (body size, header
timeout, the address); access.py API keys, quotas and the access log; gate.py the wrapper that
identifies, admits and counts every request; metrics.py GET /metrics; documents.py documents in a
request ("format") and POST /translate/file; page.py the page at GET /.

Entry points: `server.serve`, `server.create_app`.
May import: every wing before it (model, runtime, experiment, interop, data, decoding, documents,
training).
"""
