"""Code behind the Triton Python-backend models: the CPU engine lives in `engine/`
(docs/architecture.md, Components and layers)."""
