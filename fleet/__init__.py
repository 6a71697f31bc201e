"""Fleet: the `fleet` CLI, local process supervision and helpers shared by every component."""
