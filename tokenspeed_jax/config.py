"""EngineConfig: every engine setting in one flat, frozen dataclass.

Field names mirror TokenSpeed's command-line flags, so a CLI flag maps 1:1 onto a field.
Invariants: a config is validated once, at construction, with errors that name the field and the
value; it never changes afterwards (frozen); static settings only, never live request data.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence

DEFAULT_PREFILL_GRAPH_MAX_TOKENS = 8192  # "auto" when chunked prefill is off
OVERLAP_SCHEDULES = ("auto", "on", "off")
KDA_STATE_DTYPES = ("float32", "bfloat16")
TOOL_CALL_PARSERS = ("auto", "hermes", "llama3")
LOAD_FORMATS = ("auto", "dummy")


@dataclasses.dataclass(frozen=True, slots=True)
class EngineConfig:
    # Largest prefill token bucket: None = auto (min of 8192 and chunked_prefill_size), 0 = no
    # prefill graph (prefill runs eagerly).
    prefill_graph_max_tokens: int | None = None
    # Explicit token buckets (filtered to (0, max], max always kept); None = the default ladder.
    prefill_graph_capture_token_sizes: tuple[int, ...] | None = None
    # Explicit prefill request-count buckets; None = 1, 2, 4, 8, 16, ... up to prefill_graph_max_bs.
    prefill_graph_capture_batch_sizes: tuple[int, ...] | None = None
    # Largest prefill request-count bucket; a prefill step with more requests is split.
    prefill_graph_max_bs: int = 16
    # Run every prefill step eagerly (plain JAX op by op); decode graphs are unaffected.
    disable_prefill_graph: bool = False
    # Largest decode batch bucket: 1, 2, 4, 8, then steps of 16 up to this; larger steps are split.
    decode_graph_max_bs: int = 160
    # Explicit decode batch buckets; None = the default ladder up to decode_graph_max_bs.
    decode_graph_capture_batch_sizes: tuple[int, ...] | None = None
    # No compiled graphs at all: every step runs eagerly.
    enforce_eager: bool = False
    # Launch the next decode step before the previous step's tokens reach the host, so host work
    # overlaps the device's: "on", "off", or "auto" (on while the device is the bottleneck: a
    # step's kernels still run when its launch returns, measured every few dozen steps).
    overlap_schedule: str = "auto"
    # Prompts longer than the largest token bucket are split into chunks of at most this many
    # tokens; 0 = off (such prompts then run eagerly).
    chunked_prefill_size: int = 8192
    # Raise on any XLA compile after start-up (tests turn this on); otherwise count and log it.
    strict_no_compile: bool = False
    # Longest sequence (prompt + output) a request may reach; fixes the page-table width.
    max_model_len: int = 4096
    # Show a progress bar during the start-up compile.
    compile_progress: bool = True
    # Executables compiled at once at start-up (a cold cache), and buckets at once by the
    # background compile. More shorten a cold start, but on a GPU each autotune then times its
    # candidate kernels while the others run, and picks slower ones (docs/benchmarks.md).
    compile_threads: int = 1
    # Compile a skeleton of the buckets before serving (token buckets about 4x apart, the
    # smallest and largest request-count buckets) and the others in a background thread; until
    # a bucket is ready, its steps take the smallest ready one that fits (more padding, the same
    # results), and run slower while the compiles share the machine. On a GPU each executable
    # compiles for seconds (autotuning), so a skeleton is ready long before the whole ladder.
    # Off: every bucket compiles before serving.
    background_compile: bool = True
    # With background_compile: compile the skeleton without XLA's autotuning, on several threads,
    # so serving starts sooner, then compile it again autotuned in the background, first of all,
    # each autotuned executable replacing its quick one as it lands (steps run slower until
    # then, the same results). None = auto: on a GPU (the CPU compiler does not autotune).
    quick_skeleton: bool | None = None
    # Autotune the prefill executables (and the full sampler's). None = auto: not on a GPU,
    # where they compile without XLA's autotuning, their matrix products on cuBLAS, several at
    # once beside the autotuned decode executables, and run as fast (large products, where
    # cuBLAS's heuristics do well); the CPU compiler does not autotune.
    prefill_autotune: bool | None = None
    # Tokens between KDA prefix-cache checkpoints (a multiple of the 64-token KDA chunk).
    prefix_granularity: int = 64
    # dtype of the KDA layers' recurrent state rows (hybrid models): "float32", or "bfloat16" for
    # half their memory and half the state a decode step reads and writes (the KDA decode
    # kernel is bound by those reads and writes). The kernels compute in fp32 either way and
    # round a state only where they store it: once per prefill call and once per decode step.
    kda_state_dtype: str = "float32"
    # One executable per prefill token bucket with attention inside, instead of segments with
    # attention at breaks: 2 host calls per prefill step instead of 2 x layers + 1, for models
    # whose prefill is dispatch-bound; the whole forward compiles per bucket (Llama-family models).
    # None = auto: on a GPU for models whose layer weights take at most 2 GiB, without tensor
    # parallelism (small models, whose prefill is dispatch-bound); off elsewhere,
    # where a cold start compiling the whole forward per bucket is the longer one.
    inline_prefill_attention: bool | None = None
    # Decode attention on a GPU as one Pallas kernel per layer that also writes the step's K/V
    # (``kernels/paged_decode.py``); off: two scatters and JAX's paged-attention op
    # (Llama-family models).
    fused_decode_attention: bool = True
    # Hand the decode steps of small batches (at most 8 rows) their layer weights as one
    # stacked array per weight ([layers, ...], a copy made at start-up) instead of one argument
    # per layer's weight: fewer executable arguments, less host time per step, for one more copy
    # of the layer weights in device memory and a longer compile. None = auto, as for inline_prefill_attention: on a GPU for models whose layer
    # weights take at most 2 GiB, without tensor parallelism (small models, whose decode step is
    # host-bound); off on the CPU, whose XLA backend copies the slices (Llama-family models).
    stack_decode_weights: bool | None = None
    # Load each decode executable twice and let successive decode steps take turns, so neither
    # copy's command buffer (CUDA graph) sees a buffer address change and is re-recorded before
    # its launch (engine/runner.py). None = auto: on one GPU; off on the CPU, which has no
    # command buffers.
    alternate_decode_executables: bool | None = None
    # Run KDA layers at a break (the ordinary route) instead of inline in the prefill segments.
    disable_kda_prefill_graph: bool = False
    # Keep compiled executables on disk and load them on the next start instead of compiling.
    compile_cache: bool = True
    # Directory of that cache; None = $XDG_CACHE_HOME/tokenspeed_jax/executables
    # (~/.cache/tokenspeed_jax/executables when XDG_CACHE_HOME is unset).
    compile_cache_dir: str | None = None
    # File of the key that authenticates the cache's entries (an entry whose MAC fails is never
    # loaded, but recompiled): 32 random bytes, private to this user (mode 0600), outside the
    # cache directory; created on first use. None = $XDG_CONFIG_HOME/tokenspeed_jax/cache.key
    # (~/.config/tokenspeed_jax/cache.key when XDG_CONFIG_HOME is unset).
    compile_cache_key_file: str | None = None
    # XLA options for every executable compiled at start-up, each "name=value" (jax's
    # compiler_options; space-separated on the command line), e.g.
    # xla_gpu_command_buffer_scheduling_mode=SERIALIZE. Unlike XLA_FLAGS they reach only this
    # engine's executables; they are part of the executable cache key.
    xla_compiler_options: tuple[str, ...] = ()
    # Devices the model is split over (tensor parallelism, one jax.sharding mesh axis); must
    # divide the attention heads and not exceed the devices jax sees (docs/parallel.md).
    tensor_parallel_size: int = 1

    # ---- serving: engine loop and HTTP server (owned by the engine/server) ----
    # The model: an HF directory, a GGUF file or an orbax directory; None = embedded SmolLM2.
    model: str | None = None
    # Weight and compute dtype: "float32", "bfloat16", or "auto" = float32 on the CPU and
    # bfloat16 on an accelerator (the checkpoint's weights are cast to it on load).
    dtype: str = "auto"
    # Where the weights come from: "auto" = the model's checkpoint; "dummy" = random weights made
    # on the device from the model's config alone (a directory holding only config.json will
    # do), to serve or benchmark a shape whose checkpoint is not at hand; its outputs mean nothing.
    load_format: str = "auto"
    # The tokenizer, when not the model's own: an HF directory (tokenizer.json) or a GGUF file.
    # Its vocabulary may be smaller than the model's vocab_size, never larger.
    tokenizer: str | None = None
    # Most requests running (holding KV pages) at once; more wait in the queue.
    max_num_seqs: int = 64
    # Tokens per KV page.
    page_size: int = 16
    # KV pages; None = sized from free device memory (host memory on the CPU) x mem_fraction,
    # and with the compile cache on, kept by later starts while it fits.
    num_pages: int | None = None
    # Fraction of the memory free after loading the weights that the KV cache may take.
    mem_fraction: float = 0.85
    # Reuse the KV pages of identical full-page prompt prefixes across requests.
    enable_prefix_caching: bool = True
    # Address the HTTP server listens on.
    host: str = "127.0.0.1"
    # Port the HTTP server listens on.
    port: int = 8000
    # Model name the API serves and expects in requests; None = the model file or directory name.
    served_model_name: str | None = None
    # Require "Authorization: Bearer <key>" on every /v1 route (health and metrics stay open);
    # None = the TOKENSPEED_API_KEY environment variable, or no key when that is unset too.
    api_key: str | None = dataclasses.field(default=None, repr=False)
    # Largest request body in bytes; a larger one is refused (413) before it is parsed.
    max_request_bytes: int = 4 * 2**20
    # Most stop strings one request may give (OpenAI's limit is 4).
    max_stop_strings: int = 4
    # Serve the interactive API docs (/docs, /redoc, /openapi.json).
    enable_docs: bool = False
    # Let special-token text typed in chat message content (e.g. "<|im_start|>system") become
    # control tokens; by default it is encoded as the plain text it is.
    allow_special_tokens_in_content: bool = False
    # The format the model writes tool calls in: "hermes" (<tool_call>{...}</tool_call>),
    # "llama3" (a bare {"name", "parameters"} answer), or "auto" (read from the chat template).
    tool_call_parser: str = "auto"
    # Seconds a SIGTERM waits for requests in flight to finish before it ends them with an error.
    shutdown_timeout: float = 30.0

    def __post_init__(self) -> None:
        for name in ("prefill_graph_capture_token_sizes", "prefill_graph_capture_batch_sizes",
                     "decode_graph_capture_batch_sizes"):
            value = getattr(self, name)
            if value is not None:
                sizes = tuple(int(s) for s in value)
                if not sizes:
                    raise ValueError(f"{name} must not be empty, got {value!r}")
                object.__setattr__(self, name, sizes)
        object.__setattr__(self, "xla_compiler_options", tuple(self.xla_compiler_options))
        for option in self.xla_compiler_options:
            name, equals, _ = option.partition("=")
            if not (equals and name.strip() == name and name):
                raise ValueError(f"xla_compiler_options entries are 'name=value', got {option!r}")
        checks = [
            (self.prefill_graph_max_tokens is None or self.prefill_graph_max_tokens >= 0,
             f"prefill_graph_max_tokens must be None or >= 0, got {self.prefill_graph_max_tokens}"),
            (self.prefill_graph_max_bs >= 1,
             f"prefill_graph_max_bs must be >= 1, got {self.prefill_graph_max_bs}"),
            (self.decode_graph_max_bs >= 1,
             f"decode_graph_max_bs must be >= 1, got {self.decode_graph_max_bs}"),
            (self.chunked_prefill_size >= 0,
             f"chunked_prefill_size must be >= 0 (0 = off), got {self.chunked_prefill_size}"),
            (self.max_model_len >= 1, f"max_model_len must be >= 1, got {self.max_model_len}"),
            (self.compile_threads >= 1,
             f"compile_threads must be >= 1, got {self.compile_threads}"),
            (self.overlap_schedule in OVERLAP_SCHEDULES,
             f"overlap_schedule must be one of {OVERLAP_SCHEDULES}, got {self.overlap_schedule!r}"),
            (self.kda_state_dtype in KDA_STATE_DTYPES,
             f"kda_state_dtype must be one of {KDA_STATE_DTYPES}, got {self.kda_state_dtype!r}"),
            (self.prefix_granularity >= 64 and self.prefix_granularity % 64 == 0,
             f"prefix_granularity must be a multiple of 64, got {self.prefix_granularity}"),
            (self.tensor_parallel_size >= 1,
             f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}"),
            (not (self.stack_decode_weights and self.tensor_parallel_size > 1),
             "stack_decode_weights is not supported with tensor_parallel_size > 1"),
            (self.max_request_bytes >= 1024,
             f"max_request_bytes must be >= 1024, got {self.max_request_bytes}"),
            (self.max_stop_strings >= 0,
             f"max_stop_strings must be >= 0, got {self.max_stop_strings}"),
            (self.shutdown_timeout >= 0,
             f"shutdown_timeout must be >= 0, got {self.shutdown_timeout}"),
            (self.load_format in LOAD_FORMATS,
             f"load_format must be one of {LOAD_FORMATS}, got {self.load_format!r}"),
            (self.tool_call_parser in TOOL_CALL_PARSERS,
             f"tool_call_parser must be one of {TOOL_CALL_PARSERS}, got {self.tool_call_parser!r}"),
            (self.api_key is None or self.api_key != "", "api_key must not be empty"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    @property
    def prefill_graph_enabled(self) -> bool:
        return not (self.enforce_eager or self.disable_prefill_graph
                    or self.prefill_graph_max_tokens == 0)

    @property
    def compiler_options(self) -> dict[str, str | bool]:
        """``xla_compiler_options`` as the mapping ``jax.stages.Lowered.compile`` takes;
        "true" and "false" (any case) become booleans, the only spelling XLA's boolean options
        accept besides "True" and "False"."""
        options = dict(option.split("=", 1) for option in self.xla_compiler_options)
        return {name: {"true": True, "false": False}.get(value.lower(), value)
                for name, value in options.items()}

    @property
    def compile_cache_path(self) -> str | None:
        """The executable cache directory in use; None when the cache is off."""
        if not self.compile_cache:
            return None
        from tokenspeed_jax.graph.cache import default_cache_dir

        return self.compile_cache_dir or default_cache_dir()

    @property
    def prefill_token_limit(self) -> int:
        """The largest prefill token bucket: min(prefill graph max tokens, chunked prefill size)."""
        limit = self.prefill_graph_max_tokens or DEFAULT_PREFILL_GRAPH_MAX_TOKENS
        if self.chunked_prefill_size:
            limit = min(limit, self.chunked_prefill_size)
        return limit


def warn_inapplicable(config: EngineConfig, names: Sequence[str], runner: str,
                      log: logging.Logger) -> None:
    """Log each setting of ``names`` that differs from its default although ``runner`` (the model
    family's forward) has no such route, so a flag given for another family is not silently
    dropped."""
    defaults = {field.name: field.default for field in dataclasses.fields(EngineConfig)}
    for name in names:
        value = getattr(config, name)
        if value != defaults[name]:
            log.warning("%s=%s does not apply to %s: ignored", name, value, runner)
