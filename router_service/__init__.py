"""Router service: the platform's front door (KServe v2 gRPC + OpenAI HTTP + admin), routing to Triton replicas."""
