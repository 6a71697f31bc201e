"""The base package every component may import: settings, block hashing, tokenizer helpers, logging,
local process and service start-up. It imports no other package of this repository."""
