"""Generated protobuf / gRPC code for the tokenwire.v1 API (do not edit; `make protos`).

One hand-written module sits beside it: ``reasons`` (``ErrorReason`` <-> ``ErrorInfo.reason``).
"""
