"""Code behind the Triton Python-backend models (DESIGN.md §2): the CPU engine lives in `engine/`."""
