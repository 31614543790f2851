"""Generated gRPC/protobuf stubs for proto/tokengate/v1 (built by `make setup`)."""
