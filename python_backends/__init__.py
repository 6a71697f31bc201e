"""Code behind the Triton Python-backend models (docs/architecture.md, Components and layers): the CPU engine lives in `engine/`."""
