"""gRPC server reflection under both service names: ``grpc.reflection.v1.ServerReflection``
(what grpcurl, Postman and current grpc clients ask for first) and the older
``grpc.reflection.v1alpha.ServerReflection``.

grpcio-reflection ships only the v1alpha service. v1 (``grpc/reflection/v1/reflection.proto``)
is the same protocol under another package: the same messages with the same field numbers,
so the same bytes. This module adds that file to the default descriptor pool (built from the
v1alpha file with the package renamed, so reflection can describe its own v1 service) and
serves v1 with grpcio-reflection's own servicer.
"""

from __future__ import annotations

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool
from grpc_reflection.v1alpha import reflection, reflection_pb2
from grpc_reflection.v1alpha._async import ReflectionServicer

V1_PACKAGE = "grpc.reflection.v1"
V1_FILE = "grpc/reflection/v1/reflection.proto"
V1_SERVICE_NAME = f"{V1_PACKAGE}.ServerReflection"
V1ALPHA_SERVICE_NAME: str = reflection.SERVICE_NAME
_V1ALPHA_PACKAGE = reflection_pb2.DESCRIPTOR.package


def _v1_file() -> descriptor_pb2.FileDescriptorProto:
    """The v1alpha reflection file, renamed to v1 (every type reference included)."""
    proto = descriptor_pb2.FileDescriptorProto()
    reflection_pb2.DESCRIPTOR.CopyToProto(proto)
    old, new = f".{_V1ALPHA_PACKAGE}.", f".{V1_PACKAGE}."
    proto.name, proto.package = V1_FILE, V1_PACKAGE
    proto.ClearField("options")
    for message in proto.message_type:
        for field in message.field:
            if field.HasField("type_name"):  # message fields only (scalars have none)
                field.type_name = field.type_name.replace(old, new)
    for service in proto.service:
        for method in service.method:
            method.input_type = method.input_type.replace(old, new)
            method.output_type = method.output_type.replace(old, new)
    return proto


def register_v1_descriptor(pool: descriptor_pool.DescriptorPool | None = None) -> None:
    """Add the v1 reflection file to ``pool`` (the default one) unless it is there."""
    pool = pool or descriptor_pool.Default()
    try:
        pool.FindFileByName(V1_FILE)
    except KeyError:
        pool.Add(_v1_file())


def enable_reflection(service_names: tuple[str, ...], server: grpc.aio.Server) -> None:
    """Reflection over ``service_names`` plus both reflection services, as v1 and v1alpha."""
    register_v1_descriptor()
    names = (*service_names, V1_SERVICE_NAME, V1ALPHA_SERVICE_NAME)
    reflection.enable_server_reflection(names, server)  # v1alpha
    servicer = ReflectionServicer(names)
    v1 = grpc.method_handlers_generic_handler(
        V1_SERVICE_NAME,
        {
            "ServerReflectionInfo": grpc.stream_stream_rpc_method_handler(
                servicer.ServerReflectionInfo,
                request_deserializer=reflection_pb2.ServerReflectionRequest.FromString,
                response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString,
            )
        },
    )
    server.add_generic_rpc_handlers((v1,))
