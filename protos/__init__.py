"""Generated protobuf and gRPC code for Pilotfish's APIs (regenerate with scripts/gen_protos.py)."""
