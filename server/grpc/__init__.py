"""The gRPC API: services, sessions, auth, decode guard, errors and proto conversion."""
