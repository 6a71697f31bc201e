"""Fleet: the `fleet` CLI that runs the whole local platform (`fleet up/down/status`, `fleet seed`)."""
