"""The engine-agnostic llumlet: load state, CMS export thread, gRPC server."""
