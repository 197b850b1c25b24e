"""tokenwire clients: the typed gRPC client library (sync and async, sessions) and chat REPL."""
