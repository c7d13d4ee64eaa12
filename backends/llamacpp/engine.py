"""The llama.cpp engine: one thread owns the model and context and runs continuous batching.

Every step builds one `llama_batch` holding the next token of each generating sequence plus
prompt chunks of newly admitted sequences, runs one `llama_decode`, then samples each
sequence that produced logits with its own sampler chain. Requests join between steps and a
finished sequence frees its slot (its KV cells) at once, so the batch never waits for the
slowest request (the idea of llama.cpp's llama-server and vLLM's scheduler; written here
against the low-level llama.h API that llama-cpp-python exposes through ctypes).

Threading: every llama_* call that touches the model, vocabulary or context runs on the
engine thread — loading, tokenizing, decoding, sampling, freeing. The asyncio side only
enqueues work and receives results through `emit` callbacks, which the backend's Outbox
(outbox.py) turns into pushes into a per-request asyncio.Queue on the loop. The one exception is
`apply_chat_template`, a pure string function of llama.cpp that reads no model state.
After a step that gave a request its first chunk, the engine thread waits (briefly, bounded)
until the event loop has sent that chunk on: otherwise the next decode's spinning threads
hold every core and the first token reaches the client a whole step late.

Memory layout: the context has `n_seq_max = n_parallel` sequences, one per slot, with
llama.cpp's non-unified KV cache (`kv_unified = false`): each slot gets its own stream of
`n_ctx / n_parallel` cells (llama-server's classic `-c` semantics). Per-slot streams make a
sequence's arithmetic independent of what else is in the batch, so greedy output with 8
concurrent requests equals the output of each alone (the tests check this exactly).
llama.cpp splits a batch over non-unified streams into ubatches of *consecutive* seq ids, so
the batch lists slots in ascending order.

Prefix cache (llama-server's slot reuse): a finished sequence leaves its tokens in its slot's
cells. A new request goes to the idle slot whose cached tokens share the longest prefix with
its prompt (when that prefix is at least a tenth of the prompt, llama-server's default
similarity), else to the least recently used idle slot; `llama_memory_seq_rm(seq, p0, -1)`
drops the cells after the common prefix and only the rest of the prompt is decoded. A
repeated prompt and a chat's next turn thus cost only their new tokens. Within the
`prefix_store_mib` budget (on by default, as llama-server's `--cache-ram`), a slot's cells
that a new conversation is about to replace are first copied to host RAM
(`llama_state_seq_get_data`), and a returning conversation is copied back
(`llama_state_seq_set_data`) instead of being decoded again.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
import math
import os
import re
import struct
import threading
import time
from array import array
from collections import OrderedDict, deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import llama_cpp.llama_cpp as llama
import msgspec
import numpy as np

from daemon.backend import (
    DEFAULT_SAMPLERS,
    BackendError,
    ConfigError,
    EdgedError,
    GenerateChunk,
    GenerateParams,
    InfillInput,
    InvalidArgument,
    LoraAdapter,
    SlotState,
    SlotTask,
    TokenLogprob,
    ToolCallFrame,
    Unavailable,
)

from . import templates
from .ggml_backends import load_backends
from .grammar import (
    GEMMA_QUOTE,
    gbnf_including,
    gbnf_literal,
    regex_escape,
    tool_call_trigger,
    trigger_core,
)
from .templates import ChatTemplate
from .text import PieceDecoder, ReasoningTracker, StopMatcher

log = logging.getLogger(__name__)

# llama.cpp's context per slot when n_ctx is not set: the trained context, capped so a model
# trained on 128k tokens does not allocate a huge KV cache by default.
DEFAULT_CTX_PER_SLOT = 4096
# Tokens of history the repeat penalty looks at (llama.cpp's default penalty_last_n).
PENALTY_LAST_N = 64
# The longest penalty or DRY window a request may ask for beyond the slot's context: llama.cpp
# allocates a window whole when the sampler is made (DRY ~12 bytes a token), so 2e9 tokens
# took 16 GB and 42 s. Only a generation that may go on past its context reaches it.
MAX_WINDOW = 1 << 20
# A slot's cached prefix must cover this share of a new prompt for the request to take that
# slot rather than the least recently used one (llama-server's --slot-prompt-similarity).
SLOT_PROMPT_SIMILARITY = 0.1
# Steps in a row one set of LoRA scales decodes while sequences with other scales wait (one
# llama_decode applies one set to all its sequences; a change makes llama.cpp re-plan its graph).
LORA_TURN_STEPS = 16
# Text prompts whose tokens the engine remembers (most recent first), so that an identical
# prompt (a retry, a regenerated answer) skips the tokenizer: ~0.3 ms for 2 000 tokens here.
TOKEN_MEMO_ENTRIES = 8
# Prompt tokens a scored sequence (GenerateParams.prompt_logprobs) evaluates per step: each
# keeps its logits (n_vocab floats) in llama.cpp's output buffer until the step is read, so
# this bounds that buffer (64 x 152k vocabulary x 4 bytes = 39 MB) rather than n_batch would.
SCORED_PREFILL_TOKENS = 64
# After a step that produced a sequence's first chunk, the engine waits up to this long for
# the consumer to take it (see `_hand_over_first_chunks`) before it starts the next decode.
FIRST_CHUNK_HANDOFF_S = 0.003
# llama.cpp's llama_token_data, as numpy lays out an array of them (see Engine._candidates).
_TOKEN_DATA = np.dtype([("id", "<i4"), ("logit", "<f4"), ("p", "<f4")])
# The root rule of a grammar that holds only after a text (Engine._grammar_after), and of
# one the output may reason before (Engine._grammar_reasoning).
_AFTER_ROOT = "edged-after"
_REASONING_ROOT = "edged-reasoning"
# ggml log levels (ggml.h): forward warnings and errors to Python logging, drop the rest.
_GGML_LOG_WARN, _GGML_LOG_ERROR = 3, 4
# The name of the function that logged a line ("llama_adapter_lora_init_from_file_ptr: ").
_FUNCTION_PREFIX = re.compile(r"^[a-z_0-9]+: ")

Emit = Callable[[GenerateChunk | EdgedError], None]
EmbedDone = Callable[[tuple[list[list[float]], int] | EdgedError], None]
RerankDone = Callable[[tuple[list[float], int] | EdgedError], None]
# A slot action's outcome: (tokens, bytes written or read, milliseconds), or why it failed.
SlotDone = Callable[[tuple[int, int, float] | EdgedError], None]


class _SequenceFailed(Exception):
    """One sequence of a decode step cannot go on (Engine._decode_and_sample fails it alone)."""

    def __init__(self, error: EdgedError) -> None:
        super().__init__(error.message)
        self.error = error


# llama.cpp's sequence state file: magic, version, token count (llama_state_seq_save_file).
_SLOT_HEADER = struct.Struct("<III")

# llama-server's packing of a slot's tokens in a slot file (server_tokens::serialize): a null
# token, the format's version, the tokens as a counted list, then a counted list of media
# chunks (none: text only here). Its older files hold the bare tokens.
_PACKED_MARKER, _PACKED_VERSION = -1, 1

# `flash_attn` parameter -> llama.cpp's setting. The default is llama.cpp's "auto" (on for the
# CPU): side by side with llama-server on a 512x8 f16 model, 2 threads, 8 streams it gave ~1.4x
# the tokens/s of "off" on an AMD EPYC box, and a cached chat's second turn took 108 ms (vs 119
# ms off). Which is faster depends on the CPU and the context: on an Intel Xeon (portable
# build) "on" won up to ~200 cells per sequence and was 2x slower from ~1 000
# (docs/performance.md, "A portable llama.cpp build").
FLASH_ATTN = {
    "auto": llama.LLAMA_FLASH_ATTN_TYPE_AUTO,
    "on": llama.LLAMA_FLASH_ATTN_TYPE_ENABLED,
    "off": llama.LLAMA_FLASH_ATTN_TYPE_DISABLED,
}

POOLING = {
    "": llama.LLAMA_POOLING_TYPE_UNSPECIFIED,
    "mean": llama.LLAMA_POOLING_TYPE_MEAN,
    "cls": llama.LLAMA_POOLING_TYPE_CLS,
    "last": llama.LLAMA_POOLING_TYPE_LAST,
}


@dataclass(frozen=True)
class EngineSettings:
    model_name: str
    model_path: Path
    # Total KV cache tokens, split evenly across the slots; 0 = per-slot default x n_parallel.
    n_ctx: int
    n_parallel: int
    n_batch: int
    n_threads: int
    n_gpu_layers: int
    main_gpu: int
    embedding: bool
    pooling: str
    max_queue: int
    chat_template: str
    # "auto" | "on" | "off"; "" = off on the CPU, llama.cpp's auto with GPU layers.
    flash_attn: str = ""
    # Host RAM for the KV cells of conversations evicted from their slot; 0 = none.
    prefix_store_mib: int = 0
    # LoRA adapters applied to the context, in order (their ids): see LoraSpec.
    lora: tuple[LoraSpec, ...] = ()
    # llama-server's `--context-shift`: a generation that fills its slot drops older tokens
    # (Engine._shift) instead of ending with "length".
    context_shift: bool = False
    # llama-server's `--cache-reuse`: the smallest run of a slot's cached tokens, found again
    # further on in a new prompt, that is moved there instead of decoded again
    # (Engine._reuse_chunks); 0 = off. A request's GenerateParams.n_cache_reuse overrides it.
    cache_reuse: int = 0
    # The CPUs the engine's thread runs on (the instance's, InstanceContext.cpus); llama.cpp's
    # decode threads, started from it, inherit them. Empty: left where it starts.
    cpus: frozenset[int] = frozenset()


@dataclass(frozen=True)
class LoraSpec:
    """One LoRA adapter of the model's `lora` parameter: the file as the config names it,
    where that is, and its scale."""

    name: str
    path: Path
    scale: float


@dataclass
class Prepared:
    """A tokenized, validated request waiting for a slot."""

    request: Request
    tokens: list[int]
    grammar: Any = None  # a llama_sampler for the request's grammar, built at intake


class Request:
    """One generation request; `cancel` may be called from any thread."""

    def __init__(self, engine: Engine, prompt: str | list[int], params: GenerateParams, emit: Emit):
        self.prompt = prompt
        self.params = params
        self.emit = emit
        self.cancelled = False
        # Set from any thread (Engine.control): end the reasoning at the next step.
        self.end_reasoning = False
        # Set by the consumer once it has handled the first chunk (or gave up on the request).
        self.first_taken = threading.Event()
        self._engine = engine

    def cancel(self) -> None:
        # A plain attribute write is atomic; the engine reads it between steps.
        self.cancelled = True
        self.first_taken.set()
        self._engine.wake()

    def took_first(self) -> None:
        """The consumer has handled the first chunk (sent it on); any thread."""
        self.first_taken.set()


class _Job:
    """Work for the engine thread other than a generation; `cancel` from any thread."""

    def __init__(self, engine: Engine) -> None:
        self.cancelled = False
        self._engine = engine

    def cancel(self) -> None:
        self.cancelled = True
        self._engine.wake()


class EmbedJob(_Job):
    def __init__(self, engine: Engine, texts: list[str | list[int]], done: EmbedDone, truncate: bool = False):
        super().__init__(engine)
        self.texts = texts
        self.truncate = truncate
        self.done = done


class RerankJob(EmbedJob):
    """Scores of `documents` for `query` on a reranker: one rank-pooled sequence each."""

    def __init__(self, engine: Engine, query: str, documents: list[str], done: RerankDone):
        super().__init__(engine, list(documents), done)  # type: ignore[arg-type]
        self.query = query


class SlotJob(_Job):
    """llama-server's POST /slots/{id} action on one slot: runs on the engine thread once the
    slot is idle (`path`: the slot file, None for erase)."""

    def __init__(self, engine: Engine, action: str, slot: int, path: Path | None, done: SlotDone):
        super().__init__(engine)
        self.action = action
        self.slot = slot
        self.path = path
        self.done = done


@dataclass(eq=False)
class _Sequence:
    """Engine-thread state of one admitted request, bound to one slot (= seq_id)."""

    request: Request
    prompt: list[int]
    slot: int
    sampler: Any
    n_past: int = 0  # tokens of this sequence in the KV cache
    lora: tuple[float, ...] = ()  # the LoRA scales it is decoded with (Engine._scales)
    # Tokens its context shifts dropped (Engine._shift), and the cells before them, which
    # no shift moves (-1: never shifted).
    discarded: int = 0
    kept: int = -1
    next_token: int = -1  # sampled but not yet decoded; -1 while the prompt is prefilling
    generated: int = 0
    ids: list[int] = field(default_factory=list)  # sampled since the last emitted chunk
    logprobs: list[TokenLogprob] = field(default_factory=list)  # one per entry of `ids`
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)  # scored so far, not yet emitted
    decoded: list[int] = field(default_factory=list)  # generated tokens whose KV is cached
    cached: int = 0  # prompt tokens found in the slot's cache
    emitted: bool = False  # a chunk has gone to the request's consumer
    skip_bos: bool = False  # prompt_logprobs leave out the first entry: a BOS the tokenizer added
    decoder: PieceDecoder = field(default_factory=PieceDecoder)
    stops: StopMatcher = field(default_factory=lambda: StopMatcher(()))
    # Control tokens whose text stays in the output (see Engine._preserved).
    preserved: frozenset[int] = frozenset()
    # Where the output is relative to its reasoning, while that matters (see Engine._track):
    # a grammar that holds after the reasoning (grammar_after), before which the output may
    # not end; or a lazy tool frame whose grammar only sees the output outside the reasoning.
    reasoning: ReasoningTracker | None = None
    lazy: bool = False  # the second case: the lazy grammar is attached outside the reasoning only
    marker: bytes = b""  # lazy: the frame's trigger; once written outside, the call has begun
    outside: bytes = b""  # lazy: the output's end since it last left the reasoning
    budget: _Budget | None = None  # GenerateParams.reasoning_budget
    # The request's grammar sampler, applied apart from `sampler` (llama-server's rejection
    # sampling, Engine._sample); owned by `grammar_chain`, a chain of it alone.
    grammar: Any = None
    grammar_chain: Any = None
    admitted_ns: int = 0  # perf_counter_ns when the sequence took its slot
    first_ns: int = 0  # and when its first token was sampled (0: not yet)
    # llama-server's FIM stops (GenerateParams.n_indent, t_max_predict_ms), kept as its slot
    # keeps them: a sent text has had a newline; the output's bytes (n_indent only); where
    # the line n_indent checks next begins (0: none yet), and how far a newline was looked for.
    has_new_line: bool = False
    indent_text: bytearray | None = None
    last_nl: int = 0
    nl_scanned: int = 0


@dataclass
class _Budget:
    """A sequence's reasoning budget (GenerateParams.reasoning_budget), as llama-server's
    reasoning-budget sampler keeps it: tokens left inside the reasoning, then the forced end."""

    tracker: ReasoningTracker
    budget: int
    forced: list[int]  # the message and closing tag, tokenized
    # Tokens the prompt already holds inside the reasoning it opened (R1's "\n" after its
    # "<think>"): llama-server feeds them to its budget too.
    used: int = 0
    left: int = 0
    at: int = -1  # the next forced token's index while forcing, else -1
    need: int = 0  # bytes the output's last UTF-8 character still lacks

    def __post_init__(self) -> None:
        self.left = self.budget - self.used
        if self.tracker.inside and self.left <= 0:
            self.at = 0

    def next_forced(self) -> int | None:
        return self.forced[self.at] if self.at >= 0 else None

    def end_now(self) -> None:
        """Spent at once (llama-server's reasoning_end control): the end is forced next, or
        as soon as the output's last character is whole; a later reasoning ends at once too."""
        self.budget = self.left = 0
        if self.tracker.inside and self.at < 0 and self.need == 0:
            self.at = 0

    def accept(self, piece: bytes) -> None:
        if self.at >= 0:
            self.tracker.feed(piece)
            self.at += 1
            if self.at >= len(self.forced):
                # Written: whatever the tokens said, the reasoning is over.
                self.at, self.tracker.inside = -1, False
            return
        self.need = _utf8_need(self.need, piece)
        if self.tracker.feed(piece):
            self.left = self.budget  # entered (again): a fresh budget; left: nothing to count
            if self.tracker.inside and self.left <= 0:
                self.at = 0
            return
        if self.tracker.inside:
            self.left -= 1
            # Not inside a UTF-8 character (byte tokens may split one over several): the
            # forced text must not split it. A character has at most 4 bytes, so after 3
            # more tokens whatever is pending is no character (bytes that never complete
            # one) and the end is forced anyway.
            if self.left <= 0 and (self.need == 0 or self.left <= -3):
                self.at = 0


class Engine:
    """Owns one llama.cpp model + context on a dedicated thread; see the module docstring."""

    def __init__(self, settings: EngineSettings) -> None:
        self.settings = settings
        self.name = settings.model_name
        # Resolved by the engine thread before `ready` completes.
        self.ready: Future[None] = Future()
        self.n_ctx_seq = 0
        self.n_vocab = 0
        self.n_embd = 0
        # An embedding model whose GGUF and config name no pooling: llama.cpp would give one
        # vector per token, which edged averages instead (see load).
        self.unpooled = False
        # An embedding model whose context pools by rank (a reranker: its GGUF's pooling is
        # rank): it scores query-document pairs (`submit_rerank`) and embeds nothing.
        self.reranker = False
        self._n_cls_out = 0
        self._rerank_template: str | None = None
        self.chat_template: ChatTemplate | None = None
        # Whether llama.cpp can renumber this model's cached positions (not M-RoPE's several
        # per token): what a context shift needs.
        self.can_shift = False
        # Whether the memory keeps one cell per token that can be moved on its own (not a
        # recurrent state, Mamba's or RWKV's, nor a hybrid holding one): what cache reuse needs.
        # llama.cpp says a recurrent memory "can shift" (it only renumbers positions), but its
        # state still holds every token it was fed.
        self.has_cells = False
        # Whether a prompt's text is tokenized with a BOS before it: Ollama's prompt truncation
        # keeps it beside the tokens num_keep counts.
        self.adds_bos = False
        # The LoRA adapters the model is loaded with, in the order of settings.lora (their
        # ids), and the scales a request that names none gets (`set_lora_scales`; written by
        # other threads, read by the engine's at each admission: one reference swapped).
        self._adapters: list[LoraAdapter] = []
        self._lora_ptrs: list[Any] = []
        self._lora_defaults: tuple[float, ...] = tuple(spec.scale for spec in settings.lora)

        self._cond = threading.Condition()
        # Held by other threads while they use the vocabulary, and by the engine thread while
        # it frees the model.
        self._vocab_lock = threading.Lock()
        self._inbox: deque[Request | EmbedJob | SlotJob] = deque()
        self._pending = 0  # submitted but not yet admitted to a slot (guarded by _cond)
        self._stopping = False
        self._failure = ""  # set when the engine thread died: why new requests are refused
        self._tokens_generated = 0  # sampled tokens since load, every sequence together
        self._step_ns = 0  # time in decode steps (batch, llama_decode, sampling) since load
        self._prompt_cached = 0  # prompt tokens served from a slot's cache
        self._prompt_evaluated = 0  # prompt tokens decoded
        # llama-server's /metrics counters (its llamacpp:* families): time from admission to
        # the first token and from there to the end, summed over sequences; decode calls,
        # busy slots summed over them, and the most tokens one slot has held.
        self._prompt_ns = 0
        self._generation_ns = 0
        self._decodes = 0
        self._busy_decoding = 0
        self._n_tokens_max = 0

        # Engine-thread state.
        self._model: Any = None
        self._ctx: Any = None
        self._vocab: Any = None
        self._memory: Any = None
        self._batch: Any = None
        self._n_batch = 0
        self._slots: list[_Sequence | None] = [None] * settings.n_parallel
        # Tokens whose KV cells each slot holds (also while idle: the prefix cache), and
        # when each slot was last given a request (LRU order).
        self._cached: list[list[int]] = [[] for _ in range(settings.n_parallel)]
        # The LoRA scales each slot's cells were decoded with: a prefix decoded with other
        # scales is not a prefix of this request's (see _scales).
        self._cached_lora: list[tuple[float, ...]] = [() for _ in range(settings.n_parallel)]
        # The scales set on the context now, and how many steps in a row they have decoded
        # while sequences with other scales waited (see _lora_group).
        self._applied_lora: tuple[float, ...] = ()
        self._lora_steps = 0
        self._last_used: list[int] = [0] * settings.n_parallel
        self._admitted = 0
        # Host-RAM store of evicted slot caches ((LoRA scales, tokens) -> llama_state_seq
        # data), LRU order.
        self._store: OrderedDict[tuple[tuple[float, ...], tuple[int, ...]], Any] = OrderedDict()
        self._store_budget = settings.prefix_store_mib * 2**20
        self._store_bytes = 0
        self._store_hits = 0
        self._waiting: deque[Prepared] = deque()
        self._slot_jobs: list[SlotJob] = []  # in arrival order, each waiting for its slot
        # Requests whose first chunk the last step emitted (see _hand_over_first_chunks).
        self._first_chunks: list[Request] = []
        self._pieces: dict[int, bytes] = {}
        self._eog: list[int] | None = None  # end-of-generation tokens, found when first needed
        self._byte_tokens: dict[int, int] | None = None  # one-byte piece -> token, found when first needed
        self._space_prefix: bool | None = None  # see `_as_text`, found when first needed
        self._token_memo: OrderedDict[str, list[int]] = OrderedDict()
        self._piece_buf = ctypes.create_string_buffer(256)
        self._candidate_buffer: np.ndarray | None = None  # see _candidates
        self._candidate_ids: np.ndarray | None = None

        self._thread = threading.Thread(
            target=self._run, name=f"llamacpp-{settings.model_name}", daemon=True
        )
        self._thread.start()

    # ------------------------------------------------------------------ any thread

    def wake(self) -> None:
        with self._cond:
            self._cond.notify()

    def check_capacity(self) -> None:
        with self._cond:
            self._check_capacity_locked()

    def submit(self, prompt: str | list[int], params: GenerateParams, emit: Emit) -> Request:
        request = Request(self, prompt, params, emit)
        self._enqueue(request)
        return request

    def submit_embed(self, texts: list[str | list[int]], done: EmbedDone, *, truncate: bool = False) -> EmbedJob:
        job = EmbedJob(self, texts, done, truncate)
        self._enqueue(job)
        return job

    def submit_rerank(self, query: str, documents: list[str], done: RerankDone) -> RerankJob:
        job = RerankJob(self, query, documents, done)
        self._enqueue(job)
        return job

    def control(self, control_id: str, action: str) -> str:
        """From any thread: see GenerationBackend.control (the routes check `action`)."""
        # Racy but harmless reads of engine state (copied whole under the GIL): a request
        # found is flagged, and the engine thread acts on the flag at its next step.
        with self._cond:
            inbox = [item for item in self._inbox if isinstance(item, Request)]
        requests = [seq.request for seq in list(self._slots) if seq is not None]
        requests += [item.request for item in list(self._waiting)] + inbox
        found = [r for r in requests if control_id and r.params.control_id == control_id and not r.cancelled]
        if not found:
            return "no active completion for this id"
        if action != "reasoning_end":
            return "unknown control action"
        armed = [r for r in found if r.params.reasoning_control and r.params.reasoning_budget is not None]
        if not armed:
            return "reasoning control not enabled for this completion (or its model does not reason)"
        for request in armed:
            request.end_reasoning = True
        self.wake()
        return ""

    def submit_slot_action(self, action: str, slot: int, path: Path | None, done: SlotDone) -> SlotJob:
        job = SlotJob(self, action, slot, path, done)
        self._enqueue(job)
        return job

    def stats(self) -> dict[str, int | float]:
        """Slots, queue and cache counters (a racy but harmless read of engine state)."""
        slots = list(self._slots)
        busy = sum(1 for seq in slots if seq is not None)
        cells = sum(
            seq.n_past if seq is not None else len(cached)
            for seq, cached in zip(slots, list(self._cached), strict=True)
        )
        return {
            "slots": self.settings.n_parallel,
            "busy": busy,
            "queued": self._pending,
            "max_queue": self.settings.max_queue,
            "tokens_generated": self._tokens_generated,
            "decode_seconds": self._step_ns / 1e9,
            "prompt_tokens_cached": self._prompt_cached,
            "prompt_tokens_evaluated": self._prompt_evaluated,
            "prompt_seconds": self._prompt_ns / 1e9,
            "generation_seconds": self._generation_ns / 1e9,
            "decode_calls": self._decodes,
            "busy_slots_decoding": self._busy_decoding,
            "n_tokens_max": self._n_tokens_max,
            "kv_cells_used": cells,
            "kv_cells_total": self.n_ctx_seq * self.settings.n_parallel,
            "prefix_store_budget_bytes": self._store_budget,
            "prefix_store_entries": len(self._store),
            "prefix_store_bytes": self._store_bytes,
            "prefix_store_hits": self._store_hits,
            "can_shift": int(self.can_shift),
            "adds_bos": int(self.adds_bos),
        }

    def model_facts(self) -> dict[str, int]:
        """From any thread: llama.cpp's facts about the model that llama-server's /v1/models
        lists under `meta` (its vocabulary's type and size, trained context, embedding width,
        parameters and bytes)."""
        with self._vocab_lock:
            self._require_model()
            return {
                "vocab_type": int(llama.llama_vocab_type(self._vocab)),
                "n_vocab": int(llama.llama_vocab_n_tokens(self._vocab)),
                "n_ctx_train": int(llama.llama_model_n_ctx_train(self._model)),
                "n_embd": int(llama.llama_model_n_embd(self._model)),
                "n_params": int(llama.llama_model_n_params(self._model)),
                "size": int(llama.llama_model_size(self._model)),
            }

    def describe(self) -> tuple[str | None, str, str, str | None]:
        """From any thread: the chat template's text where it is Jinja (None else), the BOS
        and EOS tokens' texts ("" when none) and the weights' type as llama.cpp names it
        (None when the GGUF does not say: llama.cpp would guess it)."""
        with self._vocab_lock:
            self._require_model()
            text = None
            if self.chat_template is not None and self.chat_template.jinja:
                # Jinja is either the configured text or the GGUF's (templates.resolve).
                raw = self.settings.chat_template.encode() or llama.llama_model_chat_template(self._model, None) or b""
                text = raw.decode("utf-8", errors="replace")
            buffer = ctypes.create_string_buffer(64)

            def special(token: int) -> str:
                if token < 0:
                    return ""
                return self._to_piece(token, special=True, buffer=buffer).decode("utf-8", errors="replace")

            bos, eos = special(llama.llama_vocab_bos(self._vocab)), special(llama.llama_vocab_eos(self._vocab))
            value = ctypes.create_string_buffer(32)
            ftype = None
            if llama.llama_model_meta_val_str(self._model, b"general.file_type", value, len(value)) > 0:
                name = llama.llama_ftype_name(int(value.value))
                ftype = name.decode() if name else None
            return text, bos, eos, ftype

    def slot_states(self) -> list[SlotState]:
        """Each slot now, from any thread: a racy read of engine state as `stats`, but each
        slot's figures come from one sequence object, numbered by its admission."""
        states = []
        for index in range(self.settings.n_parallel):
            while True:
                # _admit numbers a slot before it puts the sequence there, and a slot is freed
                # before it is numbered again: an unchanged number holds for what was read.
                number = self._last_used[index]
                seq = self._slots[index]
                if self._last_used[index] == number:
                    break
            task = None
            if seq is not None:
                prompt = len(seq.prompt)
                task = SlotTask(
                    id=number, params=seq.request.params, n_prompt_tokens=prompt,
                    n_prompt_tokens_cache=seq.cached,
                    n_prompt_tokens_processed=max(0, min(seq.n_past + seq.discarded, prompt) - seq.cached),
                    n_decoded=seq.generated,
                )
            states.append(SlotState(id=index, n_ctx=self.n_ctx_seq, task=task))
        return states

    def stop(self, timeout: float = 60.0) -> None:
        """Finish in-flight sequences as cancelled, fail queued ones, free llama.cpp objects."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        self._thread.join(timeout)
        if self._thread.is_alive():
            log.error("llama.cpp engine of model '%s' did not stop within %.0f s", self.name, timeout)

    def _enqueue(self, item: Request | EmbedJob | SlotJob) -> None:
        with self._cond:
            # A slot action is an operator's, one at a time, and takes no slot of its own: a
            # queue full of generations does not turn it away (llama-server queues it too).
            self._check_capacity_locked(isinstance(item, SlotJob))
            self._pending += 1
            self._inbox.append(item)
            self._cond.notify()

    def _check_capacity_locked(self, unbounded: bool = False) -> None:
        if self._failure:
            raise BackendError(self._failure)
        if self._stopping:
            raise Unavailable(f"model '{self.name}' is unloading")
        if unbounded:
            return
        # Requests that find a free slot at the next step do not wait: count only the rest.
        # (The slot list belongs to the engine thread; reading it here is racy but harmless.)
        free = sum(1 for seq in self._slots if seq is None)
        if self._pending >= self.settings.max_queue + free:
            kind = "embedding" if self.settings.embedding else "generation"
            raise Unavailable(
                f"{kind} queue for model '{self.name}' is full "
                f"({self.settings.max_queue} requests waiting)"
            )

    def _release_pending(self, count: int = 1) -> None:
        with self._cond:
            self._pending -= count

    # ------------------------------------------------------------------ engine thread

    def _run(self) -> None:
        try:
            if self.settings.cpus:
                # Started from the event loop's thread, whose CPUs (server.host-policy) are
                # not the model's.
                os.sched_setaffinity(0, self.settings.cpus)
            self._load()
        except BaseException as exc:
            self._free()
            error = exc if isinstance(exc, EdgedError) else BackendError(
                f"llama.cpp failed to load model '{self.name}': {type(exc).__name__}: {exc}"
            )
            self.ready.set_exception(error)
            return
        self.ready.set_result(None)
        try:
            self._loop()
        except BaseException as exc:  # a bug or a fatal llama.cpp error: fail loudly, not hang
            log.exception("llama.cpp engine of model '%s' crashed", self.name)
            error = BackendError(f"llama.cpp engine of model '{self.name}' failed: {exc}; reload the model")
            with self._cond:
                self._failure = error.message
            self._fail_all(error)
        finally:
            self._shutdown()

    def _load(self) -> None:
        s = self.settings
        install_log_callback()
        try:
            cpu = load_backends()
        except (OSError, RuntimeError) as exc:
            raise BackendError(f"llama.cpp cannot run model '{self.name}': {exc}") from exc
        log.info("llama.cpp runs model '%s' with CPU features: %s", self.name, cpu or "no SIMD")
        llama.llama_backend_init()
        model_params = llama.llama_model_default_params()
        model_params.n_gpu_layers = s.n_gpu_layers
        if s.n_gpu_layers != 0:
            model_params.split_mode = llama.LLAMA_SPLIT_MODE_NONE
            model_params.main_gpu = s.main_gpu
        self._model = llama.llama_model_load_from_file(str(s.model_path).encode(), model_params)
        if not self._model:
            raise BackendError(
                f"llama.cpp could not load model '{self.name}' from {s.model_path} "
                "(the daemon log has llama.cpp's reason)"
            )
        adapters = [self._load_lora(spec) for spec in s.lora]
        self._vocab = llama.llama_model_get_vocab(self._model)
        self.n_vocab = llama.llama_vocab_n_tokens(self._vocab)
        self.n_embd = llama.llama_model_n_embd_out(self._model)
        self._ctx = self._new_context(s.pooling)
        if s.embedding and llama.llama_pooling_type(self._ctx) == llama.LLAMA_POOLING_TYPE_NONE:
            # The GGUF names no pooling (a generative model used for embeddings): average
            # the token states, the usual choice for such models.
            self.unpooled = True
            llama.llama_free(self._ctx)
            self._ctx = None
            self._ctx = self._new_context("mean")
        if s.embedding and llama.llama_pooling_type(self._ctx) == llama.LLAMA_POOLING_TYPE_RANK:
            # llama.cpp's rank pooling: the classifier head's n_cls_out outputs per sequence.
            self.reranker = True
            self._n_cls_out = llama.llama_model_n_cls_out(self._model)
            template = llama.llama_model_chat_template(self._model, b"rerank")
            self._rerank_template = template.decode("utf-8", errors="replace") if template else None
        self._lora_ptrs = adapters
        if adapters:
            # On the context: each llama_decode applies one set of scales to all its sequences
            # (_lora_group picks the set, as llama-server batches only slots with equal ones).
            self._apply_lora(_f32(self._lora_defaults))
        self._memory = llama.llama_get_memory(self._ctx)
        self.can_shift = bool(llama.llama_memory_can_shift(self._memory))
        self.has_cells = self.can_shift and not (
            llama.llama_model_is_recurrent(self._model) or llama.llama_model_is_hybrid(self._model))
        self.adds_bos = bool(llama.llama_vocab_get_add_bos(self._vocab)) and llama.llama_vocab_bos(self._vocab) >= 0
        if s.cache_reuse and not self.has_cells:
            raise ConfigError(f"model '{self.name}': cache_reuse is set, but this model's memory has no cells "
                              "to move (a recurrent state)")
        if s.context_shift and not self.can_shift:
            # llama-server turns its --context-shift off with a warning; a setting that would
            # not hold is refused here.
            raise ConfigError(f"model '{self.name}': context_shift is on, but llama.cpp cannot shift this model's context")
        self._n_batch = llama.llama_n_batch(self._ctx)
        # Cells per slot after llama.cpp's rounding (for embeddings: the one shared stream).
        self.n_ctx_seq = llama.llama_n_ctx_seq(self._ctx)
        self._batch = llama.llama_batch_init(self._n_batch, 0, 1)
        self.chat_template = self._resolve_chat_template()
        # Reasoning tags that are control tokens (Ministral's [THINK]) keep their text, so that
        # the routes can split the reasoning off, as llama-server preserves them.
        self._thinking_tokens = self._control_tokens(self.chat_template.thinking) if self.chat_template else frozenset()
        log.info(
            "llama.cpp model '%s': %d slots x %d tokens of context, batch %d, %d threads%s",
            self.name, s.n_parallel, self.n_ctx_seq, self._n_batch, s.n_threads,
            ", embeddings" if s.embedding else "",
        )

    def _apply_lora(self, scales: tuple[float, ...]) -> None:
        """Set these scales (one per adapter, float32 values) on the context, if they are not
        the ones set: llama.cpp re-plans its graph after a change."""
        if scales == self._applied_lora or not self._lora_ptrs:
            return
        array = (llama.llama_adapter_lora_p_ctypes * len(self._lora_ptrs))(*self._lora_ptrs)
        values = (ctypes.c_float * len(scales))(*scales)
        if llama.llama_set_adapters_lora(self._ctx, array, len(self._lora_ptrs), values) != 0:
            raise BackendError(f"llama.cpp could not apply the LoRA adapters of model '{self.name}'")
        self._applied_lora = scales

    def _scales(self, params: GenerateParams) -> tuple[float, ...]:
        """The LoRA scales a request is decoded with, as llama-server reads its `lora`: none
        (or []) is the model's current scales; an adapter the list leaves out gets 0."""
        if not params.lora:
            return _f32(self._lora_defaults)
        asked = dict(params.lora)
        return _f32(tuple(asked.get(i, 0.0) for i in range(len(self._lora_ptrs))))

    def _lora_group(self) -> tuple[float, ...] | None:
        """The LoRA scales this step decodes with: only sequences with these take part.
        The scales set stay while they have work, for at most LORA_TURN_STEPS steps in a row
        while others wait; then the next set (in slot order) has its turn. None: all of them
        (a model without adapters)."""
        if not self._lora_ptrs:
            return None
        sets: list[tuple[float, ...]] = []
        for seq in self._slots:
            if seq is not None and seq.lora not in sets:
                sets.append(seq.lora)
        if len(sets) <= 1:
            self._lora_steps = 0
            return sets[0] if sets else self._applied_lora
        current = self._applied_lora
        if current in sets and self._lora_steps < LORA_TURN_STEPS:
            self._lora_steps += 1
            return current
        self._lora_steps = 1
        return sets[(sets.index(current) + 1) % len(sets)] if current in sets else sets[0]

    def set_lora_scales(self, scales: tuple[float, ...]) -> None:
        """The scales later requests that name none get (llama-server's POST /lora-adapters);
        running sequences keep theirs. Any thread."""
        if len(scales) != len(self._adapters):
            raise InvalidArgument(f"model '{self.name}' has {len(self._adapters)} LoRA adapters, not {len(scales)}")
        self._lora_defaults = tuple(scales)

    def lora_adapters(self) -> list[LoraAdapter]:
        """The adapters, each with the scale a request that names none gets now."""
        defaults = self._lora_defaults
        return [msgspec.structs.replace(a, scale=scale) for a, scale in zip(self._adapters, defaults, strict=True)]

    def _load_lora(self, spec: LoraSpec) -> Any:
        """One adapter of the `lora` parameter, loaded onto the model (which frees it); what
        is wrong with the file is a ConfigError naming the parameter, the file and llama.cpp's
        reason."""

        def refuse(reason: str) -> ConfigError:
            return ConfigError(f"model '{self.name}': parameters lora: adapter '{spec.name}' ({spec.path}): {reason}")

        if not spec.path.is_file():
            raise refuse("no such file" if not spec.path.exists() else "not a file")
        with _llama_errors() as errors:
            adapter = llama.llama_adapter_lora_init(self._model, str(spec.path).encode())
        if not adapter:
            reason = "; ".join(errors) or "llama.cpp could not load it (the daemon log has its reason)"
            raise refuse(f"not a LoRA adapter for this model: {reason}")
        if llama.llama_adapter_get_alora_n_invocation_tokens(adapter):
            # An activated LoRA applies from its invocation tokens on, in each sequence apart:
            # one decode with one set of adapters for every sequence cannot do that.
            raise refuse(
                "an activated LoRA (adapter.alora.invocation_tokens), which llama-server applies only "
                "from its invocation tokens on in each sequence; edged applies a model's adapters to "
                "every token of every sequence, so it does not load one"
            )
        self._adapters.append(LoraAdapter(
            path=spec.name, scale=spec.scale,
            task_name=_adapter_meta(adapter, b"adapter.lora.task_name"),
            prompt_prefix=_adapter_meta(adapter, b"adapter.lora.prompt_prefix"),
        ))
        return adapter

    def _new_context(self, pooling: str) -> Any:
        s = self.settings
        params = llama.llama_context_default_params()
        per_slot = min(llama.llama_model_n_ctx_train(self._model) or DEFAULT_CTX_PER_SLOT, DEFAULT_CTX_PER_SLOT)
        params.n_seq_max = s.n_parallel
        params.n_batch = s.n_batch
        # One ubatch per batch: a pooled embedding must be computed in one piece. (llama.cpp
        # still splits generation batches per run of consecutive streams, see above.)
        params.n_ubatch = s.n_batch
        params.n_threads = s.n_threads
        params.n_threads_batch = s.n_threads
        params.no_perf = True
        # llama.cpp's own default (auto: on where the device supports it, the CPU included):
        # measured here it gives ~1.4x tokens/s at 8 streams, and the second turn of a
        # cached chat is as fast as without it (docs/performance.md).
        params.flash_attn_type = FLASH_ATTN[s.flash_attn or "auto"]
        if s.embedding:
            # One stream that all texts of a batch share, cleared after every batch: llama.cpp
            # pools per ubatch, and a unified cache never splits a sequence across ubatches.
            params.embeddings = True
            params.kv_unified = True
            params.n_ctx = s.n_batch
            params.pooling_type = POOLING[pooling]
        else:
            params.kv_unified = False
            params.n_ctx = s.n_ctx or per_slot * s.n_parallel
        ctx = llama.llama_init_from_model(self._model, params)
        if not ctx:
            raise BackendError(
                f"llama.cpp could not create a context for model '{self.name}' "
                f"(n_ctx={params.n_ctx}, n_parallel={s.n_parallel}, n_batch={s.n_batch}; "
                "the daemon log has llama.cpp's reason)"
            )
        return ctx

    def _resolve_chat_template(self) -> ChatTemplate:
        raw = llama.llama_model_chat_template(self._model, None)
        bos, eos = llama.llama_vocab_bos(self._vocab), llama.llama_vocab_eos(self._vocab)
        return templates.resolve(
            self.name,
            self.settings.chat_template,
            raw.decode("utf-8", errors="replace") if raw else None,
            bos=self._token_text(bos),
            eos=self._token_text(eos),
            strip_bos=bool(llama.llama_vocab_get_add_bos(self._vocab)),
        )

    def _token_text(self, token: int) -> str:
        if token < 0:
            return ""
        text = llama.llama_vocab_get_text(self._vocab, token)
        return text.decode("utf-8", errors="replace") if text else ""

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not (self._stopping or self._inbox or self._waiting or self._slot_jobs or any(self._slots)):
                    self._cond.wait()
                if self._stopping:
                    return
                arrivals = list(self._inbox)
                self._inbox.clear()
            for item in arrivals:
                if isinstance(item, EmbedJob):  # a RerankJob too
                    self._release_pending()
                    self._embed(item)
                elif isinstance(item, SlotJob):
                    self._release_pending()
                    self._slot_jobs.append(item)
                else:
                    self._intake(item)
            self._drop_cancelled()
            if self._slot_jobs:
                # Before admission: an action on an idle slot runs before a waiting request
                # can take the slot (llama-server runs its tasks in order too).
                self._run_slot_jobs()
            self._admit()
            if any(self._slots):
                self._step()
            if self._first_chunks:
                self._hand_over_first_chunks()

    def _hand_over_first_chunks(self) -> None:
        """Let the event loop send the first chunks before the next decode starts.

        The decode keeps every core busy (llama.cpp's threads spin), and the event loop
        thread, woken by the chunk, then waits for the scheduler (measured here: ~3.5 ms, a
        whole decode step, for a 512x8 model on 2 cores) before it can write the first token
        to the client. Pausing this thread until the consumer has taken the chunk costs the
        batch well under a millisecond once per request and takes that wait out of the time
        to first token. Bounded: a slow or absent consumer delays the next step by at most
        FIRST_CHUNK_HANDOFF_S.
        """
        deadline = time.monotonic() + FIRST_CHUNK_HANDOFF_S
        for request in self._first_chunks:
            if not request.first_taken.wait(max(0.0, deadline - time.monotonic())):
                break
        self._first_chunks.clear()

    def _emit(self, seq: _Sequence, chunk: GenerateChunk) -> None:
        chunk.slot = seq.slot
        if not seq.emitted:
            seq.emitted = True
            self._first_chunks.append(seq.request)
            if seq.prompt_logprobs:
                chunk.prompt_logprobs = self._as_text(seq.prompt_logprobs[int(seq.skip_bos):])
                seq.prompt_logprobs = []
        seq.request.emit(chunk)

    # --------------------------------------------------------------- generation

    def _intake(self, request: Request) -> None:
        """Tokenize and validate a new request; it then waits for a free slot."""
        if request.cancelled:
            self._release_pending()
            return
        grammar = None
        try:
            if self.settings.embedding:
                raise InvalidArgument(
                    f"model '{self.name}' is loaded as an embedding model (embedding=true); "
                    "it does not generate text"
                )
            tokens = self._prompt_tokens(request.prompt, request.params.suffix)
            params = request.params
            bad = next((t for t in params.logit_bias if not 0 <= t < self.n_vocab), None)
            if bad is not None:
                raise InvalidArgument(
                    f"logit_bias: token id {bad} is out of range for model '{self.name}' "
                    f"(vocabulary of {self.n_vocab} tokens)"
                )
            if params.reasoning_budget is not None:
                self._check_budget(params)
            most = max(self.n_ctx_seq, MAX_WINDOW)
            for name, asked in (("penalty_last_n", params.penalty_last_n),
                                ("dry_penalty_last_n", params.dry_penalty_last_n)):
                if asked is not None and self._window(asked, len(tokens), params) > most:
                    raise InvalidArgument(
                        f"{name}: a window of {asked} tokens is more than this generation may hold in "
                        f"memory ({most} tokens); -1 is the context"
                    )
            if params.n_cache_reuse and not self.has_cells:
                # llama-server takes it: on a model it cannot shift, with a warning in its log,
                # and does nothing; on a recurrent one it renumbers the state's positions as
                # if the tokens it skipped were gone, and decodes after a state that holds them.
                raise InvalidArgument(f"n_cache_reuse: model '{self.name}' has no cached cells to move "
                                      "(a recurrent state); send 0")
            if params.shift_window and not self.can_shift:
                raise InvalidArgument(f"shift: llama.cpp cannot shift the context of model '{self.name}'; send "
                                      "shift false")
            if (params.n_keep or params.n_discard) and not self.settings.context_shift and not params.shift_window:
                # llama-server takes them and does nothing with them without its --context-shift.
                name = "n_keep" if params.n_keep else "n_discard"
                raise InvalidArgument(
                    f"{name}: model '{self.name}' has no context shift (its parameter context_shift "
                    "is off): a generation that fills its slot ends with finish_reason \"length\""
                )
            lazy = _is_lazy_frame(params)
            if params.grammar_after and params.grammar_reasoning[0] and not lazy:
                raise InvalidArgument("grammar_after and grammar_reasoning cannot be used together")
            if lazy and params.grammar_after and params.grammar_reasoning[1] != params.grammar_after:
                raise InvalidArgument("grammar_after: with a lazy tool_calls frame, grammar_reasoning's closing tag")
            if params.grammar and lazy:
                assert params.tool_calls is not None
                grammar = self._lazy_tool_grammar(params.grammar, params.tool_calls)
            elif params.grammar and params.grammar_after:
                grammar = self._grammar_after(params.grammar, params.grammar_after, _ending_trigger(params))
            elif params.grammar and params.grammar_reasoning[0]:
                grammar = self._grammar_reasoning(params.grammar, params.grammar_reasoning)
            elif params.grammar:
                grammar = _parsed("grammar", lambda: llama.llama_sampler_init_grammar(
                    self._vocab, params.grammar.encode(), b"root"))
        except EdgedError as exc:
            self._release_pending()
            request.emit(exc)
            return
        # max_tokens 0 generates nothing but still evaluates the prompt into a slot's cache, as
        # llama-server documents n_predict 0: editors (llama.vim) send such requests to have the
        # context they will complete in ready before they ask (_decode_and_sample ends it).
        self._waiting.append(Prepared(request, tokens, grammar))

    def _check_budget(self, params: GenerateParams) -> None:
        """A reasoning budget the engine can keep: tags to count between, and a forced end of
        tokens that can be written (an end-of-generation token would end the output instead,
        or, banned by a grammar or ignore_eos, leave nothing to sample)."""
        assert params.reasoning_budget is not None
        if params.reasoning_budget < 0:
            raise InvalidArgument(f"reasoning_budget must be >= 0, got {params.reasoning_budget}")
        if not all(params.reasoning_tags):
            raise InvalidArgument("reasoning_budget: needs reasoning_tags, the opening and closing tags")
        forced = self._tokenize(params.reasoning_end, add_special=False)
        if not forced:
            raise InvalidArgument("reasoning_budget: needs reasoning_end, the text that ends the reasoning")
        eog = next((t for t in forced if llama.llama_vocab_is_eog(self._vocab, t)), None)
        if eog is not None:
            raise InvalidArgument(
                f"reasoning_budget_message: holds {self._special_piece(eog).decode(errors='backslashreplace')!r}, "
                f"model '{self.name}''s end-of-generation token, which would end the output there"
            )

    def _lazy_tool_grammar(self, text: str, frame: ToolCallFrame) -> Any:
        """A grammar sampler for `text` (the backend's GBNF of `frame`) that holds only from
        the frame's trigger on (llama.cpp's lazy grammar; see grammar.tool_call_trigger).

        Before the trigger the grammar masks nothing and an end-of-generation token is fine
        (llama.cpp checks EOG against the grammar only once triggered); once the frame is
        complete it allows only end-of-generation, as a plain grammar does."""
        opened = len(frame.open.encode())
        accepted = self._grammar_accepts(text, frame.open + '{"')
        brace, brace_quote = accepted > opened, accepted > opened + 1
        if not frame.open and not brace:
            raise InvalidArgument("tool_calls: with an empty open, each call must be a JSON object")
        pattern = tool_call_trigger(frame, brace=brace, brace_quote=brace_quote)
        patterns = (ctypes.c_char_p * 1)(pattern.encode())
        return _parsed("tool_calls", lambda: llama.llama_sampler_init_grammar_lazy_patterns(
            self._vocab, text.encode(), b"root", patterns, 1, None, 0
        ))

    def _grammar_after(self, text: str, after: str, also: str = "") -> Any:
        """A grammar sampler for `text` that holds only from the output's first `after` on
        (GenerateParams.grammar_after), the whitespace after it allowed; or from `also`, where
        the root itself begins (a tool frame's trigger that also ends the reasoning:
        ToolCallFrame.ends_reasoning, Qwen 3.5's `<tool_call>`).

        llama.cpp's lazy grammar replays the output from the trigger into the grammar, the
        trigger's own text too, and aborts the process on text the grammar rejects: so the
        grammar here starts with `after` itself, then the caller's root. The whitespace between
        is bounded, as llama.cpp's own `space` rule: a tiny or confused model would otherwise
        write it forever."""
        rule = f"{gbnf_literal(after)} [ \\t\\r\\n]{{0,8}} root" + (" | root" if also else "")
        wrapped = f"{text}\n{_AFTER_ROOT} ::= {rule}\n"
        triggers = [f"({regex_escape(after)})".encode()] + ([f"({regex_escape(also)})".encode()] if also else [])
        patterns = (ctypes.c_char_p * len(triggers))(*triggers)
        return _parsed("grammar", lambda: llama.llama_sampler_init_grammar_lazy_patterns(
            self._vocab, wrapped.encode(), _AFTER_ROOT.encode(), patterns, len(triggers), None, 0
        ))

    def _grammar_reasoning(self, text: str, tags: tuple[str, str]) -> Any:
        """A grammar sampler for `text` that lets the output first reason between `tags`
        (GenerateParams.grammar_reasoning): the opening tag, any text up to the first closing
        tag, the whitespace after it, then the caller's root; or that root at once. As
        llama-server's grammars for thinking templates let the model think before it answers
        in the required form."""
        opening, closing = tags
        if not closing:
            raise InvalidArgument("grammar_reasoning: both tags are needed")
        wrapped = (
            f"{text}\n{_REASONING_ROOT} ::= ({gbnf_literal(opening)} edged-thought [ \\t\\r\\n]{{0,8}})? root\n"
            f"{gbnf_including('edged-thought', closing)}\n"
        )
        return _parsed("grammar", lambda: llama.llama_sampler_init_grammar(
            self._vocab, wrapped.encode(), _REASONING_ROOT.encode()))

    def _grammar_accepts(self, text: str, prefix: str) -> int:
        """How many bytes of `prefix` the grammar `text` accepts as the start of an output, fed
        one byte at a time: each byte's token is offered to the grammar (apply) before it is
        accepted, since accepting a token the grammar rejects throws inside llama.cpp, which
        aborts us."""
        grammar = _parsed("tool_calls", lambda: llama.llama_sampler_init_grammar(self._vocab, text.encode(), b"root"))
        try:
            data = (llama.llama_token_data * 1)()
            candidates = llama.llama_token_data_array(data, 1, -1, False)
            encoded = prefix.encode()
            for accepted, byte in enumerate(encoded):
                token = self._byte_token(byte)
                if token is None:
                    return accepted
                data[0] = llama.llama_token_data(token, 0.0, 0.0)
                candidates.size, candidates.selected = 1, -1
                llama.llama_sampler_apply(grammar, ctypes.byref(candidates))
                if data[0].logit == -math.inf:
                    return accepted
                llama.llama_sampler_accept(grammar, token)
            return len(encoded)
        finally:
            llama.llama_sampler_free(grammar)

    def _byte_token(self, byte: int) -> int | None:
        """A token whose piece is exactly this one byte (every byte-level BPE and byte-fallback
        SPM vocabulary has one): one walk of the vocabulary, at the first lazy tool grammar."""
        if self._byte_tokens is None:
            found: dict[int, int] = {}
            buffer = ctypes.create_string_buffer(8)
            for token in range(self.n_vocab):
                if llama.llama_token_to_piece(self._vocab, token, buffer, 8, 0, True) == 1:
                    found.setdefault(buffer.raw[0], token)
            self._byte_tokens = found
        return self._byte_tokens.get(byte)

    def _prompt_tokens(self, prompt: str | list[int], suffix: str | None = None) -> list[int]:
        if suffix is not None:
            tokens = self._infill_tokens(prompt, suffix)
        elif isinstance(prompt, str):
            tokens = self._tokenize_prompt(prompt)
        else:
            tokens = list(prompt)
            bad = next((t for t in tokens if not 0 <= t < self.n_vocab), None)
            if bad is not None:
                raise InvalidArgument(
                    f"prompt token id {bad} is out of range for model '{self.name}' "
                    f"(vocabulary of {self.n_vocab} tokens)"
                )
        if not tokens:
            raise InvalidArgument("prompt is empty")
        if len(tokens) >= self.n_ctx_seq:
            raise InvalidArgument(
                f"prompt is {len(tokens)} tokens but model '{self.name}' has a context of "
                f"{self.n_ctx_seq} tokens per sequence; shorten the prompt or raise n_ctx"
            )
        return tokens

    def _tokenize_prompt(self, text: str) -> list[int]:
        """`_tokenize(text)`, remembered for the last TOKEN_MEMO_ENTRIES distinct prompts."""
        memo = self._token_memo
        tokens = memo.get(text)
        if tokens is None:
            tokens = self._tokenize(text)
            memo[text] = tokens
            if len(memo) > TOKEN_MEMO_ENTRIES:
                memo.popitem(last=False)
        else:
            memo.move_to_end(text)
        return list(tokens)  # a copy: the memo's list is never handed out

    def _infill_tokens(self, prompt: str | list[int], suffix: str) -> list[int]:
        """Fill-in-the-middle, llama-server's prefix-suffix-middle order:
        [BOS] FIM_PRE prompt FIM_SUF suffix FIM_MID; the model writes the middle."""
        pre, suf, mid = (
            llama.llama_vocab_fim_pre(self._vocab),
            llama.llama_vocab_fim_suf(self._vocab),
            llama.llama_vocab_fim_mid(self._vocab),
        )
        if min(pre, suf, mid) < 0:
            raise InvalidArgument(
                f"suffix: model '{self.name}' has no fill-in-the-middle tokens (FIM prefix/suffix/middle)"
            )
        if not isinstance(prompt, str):
            raise InvalidArgument("suffix: only supported with a text prompt, not token ids")
        bos = llama.llama_vocab_bos(self._vocab)
        head = [bos] if self.adds_bos else []
        return [
            *head, pre, *self._tokenize(prompt, add_special=False),
            suf, *self._tokenize(suffix, add_special=False), mid,
        ]

    def _drop_cancelled(self) -> None:
        for seq in self._slots:
            if seq is not None and seq.request.cancelled:
                self._free_sequence(seq)
        if any(item.request.cancelled for item in self._waiting):
            kept: deque[Prepared] = deque()
            for item in self._waiting:
                if not item.request.cancelled:
                    kept.append(item)
                elif item.grammar:
                    llama.llama_sampler_free(item.grammar)
            self._release_pending(len(self._waiting) - len(kept))
            self._waiting = kept

    def _admit(self) -> None:
        held: deque[Prepared] = deque()  # waiting for the one slot they asked for
        while self._waiting:
            free = [i for i, seq in enumerate(self._slots) if seq is None]
            if not free:
                break
            item = self._waiting.popleft()
            wanted = item.request.params.id_slot
            if wanted >= 0:
                if self._slots[wanted] is not None:
                    held.append(item)
                    continue
                free = [wanted]
            self._release_pending()
            tokens = item.tokens
            scales = self._scales(item.request.params)
            slot, common = self._pick_slot(free, tokens, scales)
            common = self._use_store(slot, common, tokens, scales)
            params = item.request.params
            scored = params.prompt_logprobs is not None
            reuse = self.settings.cache_reuse if params.n_cache_reuse is None else params.n_cache_reuse
            if scored or not params.cache_prompt:
                # Scored: every prompt token's logits are needed, and the cache keeps none.
                # cache_prompt false: the caller asked for the whole prompt to be evaluated.
                common = 0
            elif reuse > 0 and self._cached_lora[slot] == scales:
                common = self._reuse_chunks(slot, common, tokens, reuse)
            # At least the prompt's last token is decoded again: its logits give the first
            # sampled token (llama.cpp keeps no logits for cached positions).
            keep = min(common, len(tokens) - 1)
            if keep < len(self._cached[slot]) and not llama.llama_memory_seq_rm(self._memory, slot, keep, -1):
                # A memory that cannot drop a tail (recurrent models): start the slot afresh.
                llama.llama_memory_seq_rm(self._memory, slot, -1, -1)
                keep = 0
            self._cached[slot] = tokens[:keep]
            self._cached_lora[slot] = scales
            self._admitted += 1
            self._last_used[slot] = self._admitted
            self._prompt_cached += keep
            self._prompt_evaluated += len(tokens) - keep
            tracker, grammar = None, item.grammar
            # A frame's trigger that also ends the reasoning (ToolCallFrame.ends_reasoning) closes it too.
            ending = _ending_trigger(params).encode()
            if grammar is not None and _is_lazy_frame(params) and params.grammar_reasoning[0]:
                opening, closing = params.grammar_reasoning
                tracker = ReasoningTracker(opening.encode(), (closing.encode(), ending), inside=bool(params.grammar_after))
                if tracker.inside:  # the prompt opened the reasoning: no grammar until it ends
                    llama.llama_sampler_free(grammar)
                    grammar = None
            elif grammar is not None and params.grammar_after:
                tracker = ReasoningTracker(b"", (params.grammar_after.encode(), ending), inside=True)
            sampler = self._make_sampler(params, tokens)
            seq = _Sequence(
                item.request, tokens, slot, sampler, n_past=keep, cached=keep, lora=scales,
                stops=StopMatcher(params.stop),
                preserved=self._preserved(params.tool_calls) | self._thinking_tokens,
                reasoning=tracker, grammar=grammar, grammar_chain=_owning_chain(grammar),
                admitted_ns=time.perf_counter_ns(),
            )
            if tracker is not None and tracker.opening:
                assert params.tool_calls is not None
                seq.lazy, seq.marker = True, trigger_core(params.tool_calls).encode()
            if params.reasoning_budget is not None:
                opening, closing = params.reasoning_tags
                inside = ReasoningTracker(opening.encode(), (closing.encode(),), inside=params.reasoning_opened)
                used = self._tokens_after(tokens, opening.encode()) if params.reasoning_opened else 0
                forced = self._tokenize(params.reasoning_end, add_special=False)
                seq.budget = _Budget(inside, params.reasoning_budget, forced, used)
            if params.n_indent > 0:
                seq.indent_text = bytearray()
            if params.return_progress:
                # llama-server's first progress event: the slot has its cached prefix, no more.
                self._progress(seq)
            if scored:
                # The first token has nothing before it to be scored against.
                seq.prompt_logprobs.append(TokenLogprob(tokens[0], self._piece(tokens[0]), 0.0))
                prompt = item.request.prompt
                if isinstance(prompt, str) and item.request.params.suffix is None:
                    # The text does not hold the BOS the tokenizer put before it (lm-eval-harness
                    # counts the tokens of the text alone): its entry goes, the first word's stays.
                    bos = llama.llama_vocab_bos(self._vocab)
                    seq.skip_bos = bool(llama.llama_vocab_get_add_bos(self._vocab)) and tokens[0] == bos
            self._slots[slot] = seq
        if held:
            held.extend(self._waiting)
            self._waiting = held

    def _reuse_chunks(self, slot: int, common: int, tokens: list[int], size: int) -> int:
        """llama-server's cache reuse (`n_cache_reuse`): the slot's runs that _reuse_plan
        finds are moved back to where the prompt has them (the cells before each dropped).
        Returns how many of the prompt's first tokens the slot now holds; cells after them
        (runs skipped at the end) stay until admission drops them (`_cached` keeps its length
        until then, so it does).

        The moved cells keep what was computed for them after their old prefix (llama.cpp
        only re-rotates their positions), so the output is close to, not the same as, a
        cold decode's: why it is off unless asked for (code editors ask for it, whose
        context around the cursor shifts with each edit)."""
        held = common
        for at_c, at_p, run in _reuse_plan(self._cached[slot], tokens, common, size):
            llama.llama_memory_seq_rm(self._memory, slot, at_p, at_c)
            llama.llama_memory_seq_add(self._memory, slot, at_c, at_c + run, at_p - at_c)
            log.debug("model '%s' slot %d: cache reuse, %d cells [%d, %d) -> %d", self.name, slot, run, at_c,
                      at_c + run, at_p)
            held = at_p + run
        return held

    def _use_store(self, slot: int, common: int, tokens: list[int], scales: tuple[float, ...]) -> int:
        """Save the slot's cells when a new conversation replaces them; restore a stored
        conversation into the slot when it shares more with the prompt. Returns the common
        prefix of the slot's (possibly restored) cache and the prompt."""
        if self._store_budget <= 0:
            return common
        cached = self._cached[slot]
        stored_key, stored_common = None, common
        for key in self._store:
            if key[0] != scales:
                continue
            shared = _common_prefix(key[1], tokens)
            if shared > stored_common:
                stored_key, stored_common = key, shared
        if stored_key is not None and stored_common <= SLOT_PROMPT_SIMILARITY * len(tokens):
            stored_key = None
        # The slot's cache is about to go (a restore replaces it, or most of it does not
        # match): it belongs to another conversation, which may come back.
        if cached and (stored_key is not None or common < len(cached) // 2):
            self._save(slot, cached)
        if stored_key is None:
            return common
        data = self._store[stored_key]
        self._store.move_to_end(stored_key)
        llama.llama_memory_seq_rm(self._memory, slot, -1, -1)
        if llama.llama_state_seq_set_data(self._ctx, data, len(data), slot) == 0:
            log.warning("model '%s': restoring a stored prefix failed; decoding it again", self.name)
            llama.llama_memory_seq_rm(self._memory, slot, -1, -1)
            self._cached[slot] = []
            return 0
        self._store_hits += 1
        self._cached[slot] = list(stored_key[1])
        return stored_common

    def _save(self, slot: int, cached: list[int]) -> None:
        key = (self._cached_lora[slot], tuple(cached))
        size = llama.llama_state_seq_get_size(self._ctx, slot)
        if key in self._store or size > self._store_budget:
            return
        data = (ctypes.c_uint8 * size)()
        if llama.llama_state_seq_get_data(self._ctx, data, size, slot) != size:
            return
        self._store[key] = data
        self._store_bytes += size
        while self._store_bytes > self._store_budget:
            _, evicted = self._store.popitem(last=False)
            self._store_bytes -= len(evicted)

    def _pick_slot(self, free: list[int], tokens: list[int], scales: tuple[float, ...]) -> tuple[int, int]:
        """(slot, common prefix length): the idle slot sharing the longest prefix decoded with
        the same LoRA scales, else LRU."""

        def shared(slot: int) -> int:
            return _common_prefix(self._cached[slot], tokens) if self._cached_lora[slot] == scales else 0

        best, best_common = -1, 0
        for slot in free:
            common = shared(slot)
            if common > best_common or (
                common == best_common and best >= 0 and self._last_used[slot] < self._last_used[best]
            ):
                best, best_common = slot, common
        if best >= 0 and best_common > SLOT_PROMPT_SIMILARITY * len(tokens):
            return best, best_common
        lru = min(free, key=lambda slot: self._last_used[slot])
        return lru, shared(lru)

    def _make_sampler(self, params: GenerateParams, prompt: Sequence[int]) -> Any:
        """llama-server's chain (common_sampler_init): the logit biases, the samplers in the
        order of `params.samplers` (each skipped where its fields turn it off), then the draw.
        A grammar is not in it: _sample applies it apart, as llama-server does."""
        chain = llama.llama_sampler_chain_init(llama.llama_sampler_chain_default_params())
        wanted = dict(params.logit_bias)
        if params.ignore_eos:
            # As llama-server does it: end-of-generation tokens can never be sampled.
            wanted.update(dict.fromkeys(self._eog_tokens(), -math.inf))
        if wanted:
            biases = (llama.llama_logit_bias * len(wanted))()
            for i, (token, bias) in enumerate(wanted.items()):
                biases[i] = llama.llama_logit_bias(token, bias)
            llama.llama_sampler_chain_add(
                chain, llama.llama_sampler_init_logit_bias(self.n_vocab, len(wanted), biases)
            )
        # With Mirostat llama-server ignores the order (the temperature, then Mirostat); the
        # default order's penalties and DRY stay before them here, as they always have
        # (llama-server's Mirostat chain has neither: a known difference, kept as it was).
        order = DEFAULT_SAMPLERS if params.mirostat else params.samplers
        lead = next((i for i, name in enumerate(order) if name not in ("penalties", "dry")), len(order))
        for name in order[:lead]:
            self._add_sampler(chain, name, params, prompt)
        xtc = params.xtc_probability > 0.0 and params.xtc_threshold <= 0.5  # llama.cpp: above 0.5 is off
        # At temperature 0 llama-server's default chain keeps the best token only, unless XTC
        # or typical-p drops it first (each may: the rest keep it) or a dynamic temperature
        # raises the temperature again; else it is greedy. (Another order keeps its
        # temperature sampler, which at 0 keeps the best token left where it stands.)
        if (
            order == DEFAULT_SAMPLERS and (params.greedy or params.temperature <= 0)
            and not xtc and params.typical_p >= 1.0 and params.dynatemp_range <= 0.0
        ):
            llama.llama_sampler_chain_add(chain, llama.llama_sampler_init_greedy())
            return chain
        seed = llama.LLAMA_DEFAULT_SEED if params.seed is None else params.seed & 0xFFFFFFFF
        if params.mirostat:
            # llama-server's Mirostat: the temperature, then Mirostat's own truncation and draw
            # in place of every other sampler (its m for version 1: 100 tokens).
            llama.llama_sampler_chain_add(chain, llama.llama_sampler_init_temp(params.temperature))
            if params.mirostat == 1:
                miro = llama.llama_sampler_init_mirostat(self.n_vocab, seed, params.mirostat_tau, params.mirostat_eta, 100)
            else:
                miro = llama.llama_sampler_init_mirostat_v2(seed, params.mirostat_tau, params.mirostat_eta)
            llama.llama_sampler_chain_add(chain, miro)
            return chain
        for name in order[lead:]:
            self._add_sampler(chain, name, params, prompt, seed)
        llama.llama_sampler_chain_add(chain, llama.llama_sampler_init_dist(seed))
        return chain

    def _add_sampler(
        self, chain: Any, name: str, params: GenerateParams, prompt: Sequence[int], seed: int = 0
    ) -> None:
        """One of GenerateParams.samplers, where its fields turn it on, as llama-server makes it."""
        keep = max(1, params.min_keep)
        if name == "penalties":
            repeat, freq, present = params.repeat_penalty, params.frequency_penalty, params.presence_penalty
            if params.penalty_last_n is not None:
                # One window for all three, llama.cpp's own way (Ollama's repeat_last_n).
                window = self._window(params.penalty_last_n, len(prompt), params)
                if window > 0 and (repeat != 1.0 or freq or present):
                    self._add_penalties(chain, prompt, window, repeat, freq, present)
            else:
                if repeat != 1.0:
                    # llama.cpp's repeat penalty over its usual window of recent tokens.
                    self._add_penalties(chain, prompt, PENALTY_LAST_N, repeat, 0.0, 0.0)
                if freq or present:
                    # OpenAI's penalties count every token of the text so far: the whole context.
                    self._add_penalties(chain, prompt, self.n_ctx_seq, 1.0, freq, present)
        elif name == "dry":
            if params.dry_multiplier > 0.0 and params.dry_penalty_last_n != 0:
                # Like the penalties, DRY counts the prompt's tokens and changes the best token too.
                self._add_dry(chain, prompt, params)
        elif name == "top_n_sigma":
            if params.top_n_sigma > 0.0:
                llama.llama_sampler_chain_add(chain, llama.llama_sampler_init_top_n_sigma(params.top_n_sigma))
        elif name == "top_k":
            if params.top_k > 0:
                llama.llama_sampler_chain_add(chain, llama.llama_sampler_init_top_k(params.top_k))
        elif name == "typ_p":
            if params.typical_p < 1.0:
                llama.llama_sampler_chain_add(chain, llama.llama_sampler_init_typical(params.typical_p, keep))
        elif name == "top_p":
            if params.top_p < 1.0:  # 0 too: it keeps the min_keep best (llama.cpp's, as llama-server)
                llama.llama_sampler_chain_add(chain, llama.llama_sampler_init_top_p(params.top_p, keep))
        elif name == "min_p":
            if params.min_p > 0.0:
                llama.llama_sampler_chain_add(chain, llama.llama_sampler_init_min_p(params.min_p, keep))
        elif name == "xtc":
            if params.xtc_probability > 0.0 and params.xtc_threshold <= 0.5:  # llama.cpp: above 0.5 is off
                xtc = llama.llama_sampler_init_xtc(params.xtc_probability, params.xtc_threshold, keep, seed)
                llama.llama_sampler_chain_add(chain, xtc)
        elif name == "temperature":
            temp = 0.0 if params.greedy else params.temperature
            if params.dynatemp_range > 0.0:
                sampler = llama.llama_sampler_init_temp_ext(temp, params.dynatemp_range, params.dynatemp_exponent)
            else:
                sampler = llama.llama_sampler_init_temp(temp)
            llama.llama_sampler_chain_add(chain, sampler)
        elif name == "infill":
            llama.llama_sampler_chain_add(chain, llama.llama_sampler_init_infill(self._vocab))
        else:
            raise InvalidArgument(f"samplers: unknown sampler {name!r}")

    def _as_text(self, entries: list[TokenLogprob]) -> list[TokenLogprob]:
        """A prompt's entries whose pieces join into the text the prompt stands for: an SPM
        vocabulary puts a space before the first word ("a" is " a"), which llama.cpp's
        detokenizer drops again; so is it dropped here, from the first token after any BOS."""
        if self._space_prefix is None:
            first = self._tokenize("a", add_special=False)[:1]
            self._space_prefix = bool(first) and self._piece(first[0]).startswith(b" ")
        if self._space_prefix:
            for index, entry in enumerate(entries[:2]):
                if entry.piece:  # a BOS has an empty piece
                    if entry.piece.startswith(b" "):
                        entries[index] = TokenLogprob(entry.token_id, entry.piece[1:], entry.logprob, entry.top)
                    break
        return entries

    def _eog_tokens(self) -> list[int]:
        """Every token llama.cpp ends a generation on (EOS, EOT, <|im_end|>, ...): one walk of
        the vocabulary, at the first request that asks (a 150k vocabulary takes ~0.1 s)."""
        if self._eog is None:
            self._eog = [t for t in range(self.n_vocab) if llama.llama_vocab_is_eog(self._vocab, t)]
        return self._eog

    def _window(self, asked: int, seen: int, params: GenerateParams) -> int:
        """The tokens a penalty or DRY window of `asked` (-1: the context, as llama-server
        reads both) spans for a sequence that has `seen` tokens so far: at most every token it
        can still have, which counts the same tokens as the window asked for. Unbounded only
        where the generation may go on past its context without a max_tokens."""
        if asked < 0:
            return self.n_ctx_seq
        shifts = bool(params.shift_window) or (self.settings.context_shift and params.context_shift)
        if params.max_tokens is None:
            return asked if shifts else min(asked, self.n_ctx_seq)
        most = seen + params.max_tokens
        return min(asked, most if shifts else min(most, self.n_ctx_seq))

    def _add_dry(self, chain: Any, prompt: Sequence[int], params: GenerateParams) -> None:
        breakers = [text.encode() for text in params.dry_sequence_breakers]
        array = (ctypes.c_char_p * len(breakers))(*breakers)
        window = self._window(params.dry_penalty_last_n, len(prompt), params)
        sampler = llama.llama_sampler_init_dry(
            self._vocab, params.dry_multiplier, params.dry_base, params.dry_allowed_length,
            window, array, len(breakers),
        )
        # Primed with the prompt's end on its own, as the penalties are (below).
        for token in prompt[-window:]:
            llama.llama_sampler_accept(sampler, token)
        llama.llama_sampler_chain_add(chain, sampler)

    def _add_penalties(
        self, chain: Any, prompt: Sequence[int], last_n: int, repeat: float, freq: float, present: float
    ) -> None:
        sampler = llama.llama_sampler_init_penalties(self.n_vocab, last_n, repeat, freq, present)
        # The penalties also look at the end of the prompt, as in llama.cpp's tools. Primed
        # on its own: accepting through the chain would feed the prompt to a grammar too.
        for token in prompt[-last_n:]:
            llama.llama_sampler_accept(sampler, token)
        llama.llama_sampler_chain_add(chain, sampler)

    def _step(self) -> None:
        """One llama_decode over every active sequence, then sample those that need it."""
        started = time.perf_counter_ns()
        try:
            self._decode_and_sample()
        finally:
            self._step_ns += time.perf_counter_ns() - started

    def _decode_and_sample(self) -> None:
        batch = self._batch
        n_tokens = 0
        outputs: list[tuple[_Sequence, int]] = []
        scoring: list[tuple[_Sequence, int, int]] = []  # (sequence, output index, prompt token)
        progressing: list[_Sequence] = []  # prefilled in this step, with return_progress
        group = self._lora_group()
        stepping = [seq for seq in self._slots if seq is not None and (group is None or seq.lora == group)]
        decoding = sum(1 for seq in stepping if seq.next_token >= 0)
        prefill_budget = self._n_batch - decoding

        def add(token: int, pos: int, slot: int, output: bool) -> None:
            nonlocal n_tokens
            batch.token[n_tokens] = token
            batch.pos[n_tokens] = pos
            batch.n_seq_id[n_tokens] = 1
            batch.seq_id[n_tokens][0] = slot
            batch.logits[n_tokens] = output
            n_tokens += 1

        # Ascending slot order: llama.cpp batches consecutive seq ids into one ubatch.
        for seq in stepping:
            if seq.next_token >= 0:
                outputs.append((seq, n_tokens))
                add(seq.next_token, seq.n_past, seq.slot, True)
                seq.decoded.append(seq.next_token)
                seq.n_past += 1
            elif prefill_budget > 0:
                top = seq.request.params.prompt_logprobs
                step = prefill_budget if top is None else min(prefill_budget, SCORED_PREFILL_TOKENS)
                chunk = seq.prompt[seq.n_past : seq.n_past + step]
                prefill_budget -= len(chunk)
                if seq.request.params.return_progress:
                    progressing.append(seq)
                for token in chunk:
                    last = seq.n_past == len(seq.prompt) - 1
                    if last:
                        outputs.append((seq, n_tokens))
                    elif top is not None:
                        scoring.append((seq, n_tokens, seq.prompt[seq.n_past + 1]))
                    add(token, seq.n_past, seq.slot, last or top is not None)
                    seq.n_past += 1
        batch.n_tokens = n_tokens
        if group is not None:
            self._apply_lora(group)
        status = llama.llama_decode(self._ctx, batch)
        if status != 0:
            # Not expected (each slot has its own cells and prompts are checked against
            # them): fail every active sequence rather than guess which KV state survived.
            error = BackendError(f"llama_decode failed for model '{self.name}' (status {status})")
            log.error("%s", error.message)
            self._fail_all(error)
            return
        self._decodes += 1
        for seq in stepping:
            self._busy_decoding += 1
            self._n_tokens_max = max(self._n_tokens_max, seq.n_past)
        for seq in progressing:
            # After each decode of the prompt, before its first token (llama-server's order).
            self._progress(seq)
        for seq, index, token in scoring:
            if self._slots[seq.slot] is not seq:
                continue  # failed at an earlier position of this step
            top = seq.request.params.prompt_logprobs or 0
            try:
                seq.prompt_logprobs.append(self._token_logprob(self._log_softmax(index), token, top))
            except _SequenceFailed as exc:
                self._fail(seq, exc.error)
        for seq, index in outputs:
            if self._slots[seq.slot] is not seq:
                continue  # failed while its prompt was scored
            if seq.request.params.max_tokens == 0:
                # Nothing to generate: the prompt is in the slot's cache now (and scored,
                # with prompt_logprobs).
                self._finish(seq, "length", "", flush=False)
                continue
            try:
                wanted = seq.request.params.logprobs
                post = wanted is not None and seq.request.params.post_sampling_probs
                # Read before sampling: the model's own distribution, not the sampler's.
                logprobs = self._log_softmax(index) if wanted is not None and not post else None
                if seq.reasoning is not None and seq.reasoning.inside and not seq.lazy:
                    self._hold_end(index)
                if seq.request.end_reasoning and seq.budget is not None:
                    seq.request.end_reasoning = False
                    seq.budget.end_now()
                forced = seq.budget.next_forced() if seq.budget is not None else None
                if forced is not None and seq.grammar is not None and not self._allows(seq.grammar, forced):
                    # The grammar holds the output to something else here (a message that writes a
                    # tag or a call marker itself): forcing would leave no token at all, so the
                    # budget gives way to the grammar.
                    seq.budget, forced = None, None
                if forced is not None:
                    self._force(index, forced)
                token, candidates = self._sample(seq, index, keep_candidates=post)
                if forced is not None and token != forced:
                    # Not expected (intake refuses an end-of-generation token in the message, and
                    # the grammar was asked above): stop forcing rather than write the rest after
                    # a token that was not the message's.
                    log.warning("model '%s': a forced reasoning-budget token was not sampled; budget dropped", self.name)
                    seq.budget = None
                if logprobs is not None and wanted is not None:
                    seq.logprobs.append(self._token_logprob(logprobs, token, wanted, seq.preserved))
                elif candidates is not None and wanted is not None:
                    seq.logprobs.append(self._sampled_prob(candidates, token, wanted, seq.preserved))
            except _SequenceFailed as exc:
                self._fail(seq, exc.error)
                continue
            self._accept(seq, token)

    def _track(self, seq: _Sequence, token: int, piece: bytes) -> None:
        """Follow the output in and out of its reasoning (token texts as llama.cpp's grammar
        triggers see them, control tokens' too).

        grammar_after: once the output leaves the reasoning, the (lazy-pattern) grammar has
        taken over and nothing more is tracked. A lazy tool frame: llama-server keeps its lazy
        grammar from seeing the reasoning (a call marker the model writes while it thinks
        starts no call there), so the grammar is attached to the sampler chain only outside
        the reasoning, a fresh one each time the output leaves it; once the frame's trigger is
        written outside, a call has begun and the chain stays as it is."""
        assert seq.reasoning is not None
        if not seq.reasoning.feed(piece):
            if seq.lazy and not seq.reasoning.inside:
                seq.outside = (seq.outside + piece)[-max(len(seq.marker), 1) * 2 :]
                if seq.marker and seq.marker in seq.outside:
                    seq.reasoning = None
            return
        if not seq.lazy:
            seq.reasoning = None
            return
        params = seq.request.params
        assert params.tool_calls is not None
        grammar = None
        if not seq.reasoning.inside:
            grammar = self._lazy_tool_grammar(params.grammar, params.tool_calls)
            if seq.reasoning.ended_by == seq.marker:
                # The trigger ended the reasoning (Qwen 3.5's `<tool_call>`): replayed into the
                # grammar, as llama-server replays a reasoning's end, it starts the call.
                for replayed in self._tokens_ending_with([*seq.decoded, token], seq.marker):
                    llama.llama_sampler_accept(grammar, replayed)
                seq.reasoning = None
        # The new chain counts the output so far as the prompt, for the penalties and DRY.
        sampler = self._make_sampler(params, seq.prompt + seq.decoded + [token])
        llama.llama_sampler_free(seq.sampler)
        if seq.grammar_chain is not None:
            llama.llama_sampler_free(seq.grammar_chain)
        seq.sampler, seq.grammar, seq.grammar_chain, seq.outside = sampler, grammar, _owning_chain(grammar), b""

    def _tokens_after(self, tokens: list[int], text: bytes) -> int:
        """How many of the last `tokens` begin after the last `text` in their texts."""
        found = self._last_occurrence(tokens, text)
        if found is None:
            return 0
        start, at = found
        end, offset, after = at + len(text), 0, 0
        for token in tokens[start:]:
            after += offset >= end
            offset += len(self._special_piece(token))
        return after

    def _tokens_ending_with(self, tokens: list[int], text: bytes) -> list[int]:
        """The fewest last `tokens` whose texts (control tokens' too) hold `text`."""
        found = self._last_occurrence(tokens, text)
        return tokens if found is None else tokens[found[0] :]

    def _last_occurrence(self, tokens: list[int], text: bytes) -> tuple[int, int] | None:
        """The token where the last `text` in the tokens' texts begins and its offset in the
        text from that token on (None: there is none). Read backwards, only as far as needed,
        each piece once: an occurrence not seen yet starts in the piece just added."""
        tail = b""  # what follows the piece, as far as an occurrence starting in it can reach
        for start in range(len(tokens) - 1, -1, -1):
            window = self._special_piece(tokens[start]) + tail
            at = window.rfind(text)
            if at >= 0:
                return start, at
            tail = window[: max(len(text) - 1, 0)]
        return None

    def _sample(self, seq: _Sequence, index: int, *, keep_candidates: bool = False) -> tuple[int, Any]:
        """The next token of `seq` from output `index`'s logits, accepted into its samplers,
        and the candidate array the draw was made from (None unless `keep_candidates` or a
        grammar needed it; valid until the next sampling).

        With a grammar, llama-server's rejection sampling (common_sampler_sample): the chain
        alone picks a token; only if the grammar rejects it are the logits masked by the
        grammar and the chain applied again (a second draw). The same draws as llama-server's
        for a seed, and the grammar checks one token rather than the whole vocabulary on most
        steps."""
        if seq.grammar is None and not keep_candidates:
            return int(llama.llama_sampler_sample(seq.sampler, self._ctx, index)), None
        # llama_sampler_sample's steps, on an array this engine can read afterwards.
        candidates = self._candidates(index)
        llama.llama_sampler_apply(seq.sampler, ctypes.byref(candidates))
        token = int(candidates.data[candidates.selected].id)
        if seq.grammar is not None and not self._allows(seq.grammar, token):
            candidates = self._candidates(index)
            llama.llama_sampler_apply(seq.grammar, ctypes.byref(candidates))
            llama.llama_sampler_apply(seq.sampler, ctypes.byref(candidates))
            token = int(candidates.data[candidates.selected].id)
        if seq.grammar is not None:
            if not self._allows(seq.grammar, token):
                # Every token the grammar allows was at -inf (logit_bias bans them all, or no
                # token continues the grammar): the draw fell on another, and accepting it into
                # the grammar throws a C++ exception through the C API, which ends the process.
                raise _SequenceFailed(InvalidArgument(
                    f"grammar: at output token {seq.generated + 1} no token is left that the grammar allows "
                    "(logit_bias bans them all, or none of the model's tokens continues the grammar)"
                ))
            llama.llama_sampler_accept(seq.grammar, token)
        llama.llama_sampler_accept(seq.sampler, token)
        return token, candidates

    def _sampled_prob(self, candidates: Any, token: int, top: int, kept: frozenset[int]) -> TokenLogprob:
        """GenerateParams.post_sampling_probs' entry, as llama-server's populate_token_probs:
        the candidates left after the chain by their probability (the draw's softmax), the
        token's own and the `top` most likely above 0. A chain that ends in the greedy pick
        computes none; llama-server's (the temperature at 0, then the draw) gives the best
        token probability 1 and the rest 0, and so does this."""
        piece = functools.partial(self._kept_piece, kept=kept)
        left = np.ctypeslib.as_array(candidates.data, shape=(int(candidates.size),))
        probs = left["p"].astype(np.float64)
        if not np.isfinite(probs).all():
            raise self._nan_logits("probabilities")
        if not probs.any():
            return TokenLogprob(token, piece(token), 0.0, [TokenLogprob(token, piece(token), 0.0)] if top else [])
        order = np.argsort(-probs, kind="stable")
        ids = left["id"][order]
        sorted_probs = probs[order]
        where = np.flatnonzero(ids == token)
        own = float(sorted_probs[where[0]]) if where.size else 0.0
        best = [
            TokenLogprob(int(t), piece(int(t)), math.log(p))
            for t, p in zip(ids[:top], sorted_probs[:top], strict=True)
            if p > 0.0
        ]
        # Zero probability (a token the chain cut): -inf, which the route writes as 0.
        return TokenLogprob(token, piece(token), math.log(own) if own > 0.0 else -math.inf, best)

    def _candidates(self, index: int) -> Any:
        """Output `index`'s logits as llama.cpp's candidate array (every token, unsorted), in
        a buffer this engine keeps: the samplers reorder and cut it in place."""
        if self._candidate_buffer is None:
            self._candidate_buffer = np.zeros(self.n_vocab, dtype=_TOKEN_DATA)
            self._candidate_ids = np.arange(self.n_vocab, dtype=np.int32)
        buffer = self._candidate_buffer
        buffer["id"] = self._candidate_ids
        buffer["logit"] = np.ctypeslib.as_array(llama.llama_get_logits_ith(self._ctx, index), shape=(self.n_vocab,))
        buffer["p"] = 0.0
        data = buffer.ctypes.data_as(ctypes.POINTER(llama.llama_token_data))
        return llama.llama_token_data_array(data, self.n_vocab, -1, False)

    def _allows(self, grammar: Any, token: int) -> bool:
        """Whether `grammar` (a sampler in a chain; applying it changes nothing) admits `token`
        next."""
        data = (llama.llama_token_data * 1)(llama.llama_token_data(token, 0.0, 0.0))
        candidates = llama.llama_token_data_array(data, 1, -1, False)
        llama.llama_sampler_apply(grammar, ctypes.byref(candidates))
        return bool(data[0].logit != -math.inf)

    def _force(self, index: int, token: int) -> None:
        """Only `token` at output `index` (a reasoning budget's forced end, as llama-server's
        budget sampler forces it: every other logit -inf, then the sampler chain as ever)."""
        logits = np.ctypeslib.as_array(llama.llama_get_logits_ith(self._ctx, index), shape=(self.n_vocab,))
        kept = float(logits[token])
        logits[:] = -np.inf
        logits[token] = kept

    def _hold_end(self, index: int) -> None:
        """No end-of-generation token at output `index`: the grammar that holds after
        GenerateParams.grammar_after has not started yet, and llama.cpp's lazy grammar lets
        the output end before its trigger. llama-server's grammar for such a reply (a thinking
        prompt with tool_choice required, or a response format) spans the reasoning too, so
        its reply never ends without the call or the answer; nor does this one."""
        logits = llama.llama_get_logits_ith(self._ctx, index)
        for token in self._eog_tokens():
            logits[token] = -math.inf

    def _log_softmax(self, index: int) -> np.ndarray:
        logits = np.ctypeslib.as_array(llama.llama_get_logits_ith(self._ctx, index), shape=(self.n_vocab,))
        top = float(logits.max())  # NaN if any is
        if not math.isfinite(top):
            raise self._nan_logits("logprobs")
        shifted = logits.astype(np.float64) - top
        return shifted - float(np.log(np.exp(shifted).sum()))

    def _token_logprob(
        self, logprobs: np.ndarray, token: int, top: int, kept: frozenset[int] = frozenset()
    ) -> TokenLogprob:
        """`kept`: control tokens whose text stays in this output (`_Sequence.preserved`); their
        entries carry that text too."""
        piece = functools.partial(self._kept_piece, kept=kept)
        best: list[TokenLogprob] = []
        if top > 0:
            ids = np.argpartition(-logprobs, top - 1)[:top]
            ids = ids[np.argsort(-logprobs[ids], kind="stable")]
            best = [TokenLogprob(int(t), piece(int(t)), float(logprobs[t])) for t in ids]
        return TokenLogprob(token, piece(token), float(logprobs[token]), best)

    def _kept_piece(self, token: int, kept: frozenset[int]) -> bytes:
        """A token's bytes in a logprob entry: a control token's text where the output keeps
        it (`kept`, _Sequence.preserved), else what detokenizing writes."""
        return self._special_piece(token) if token in kept else self._piece(token)

    def _accept(self, seq: _Sequence, token: int) -> None:
        self._tokens_generated += 1
        if not seq.first_ns:
            seq.first_ns = time.perf_counter_ns()
            self._prompt_ns += seq.first_ns - seq.admitted_ns
        seq.generated += 1
        seq.ids.append(token)
        if seq.reasoning is not None or seq.budget is not None:
            # The token's text as triggers and tags are matched: control tokens' too.
            special = self._special_piece(token)
            if seq.reasoning is not None:
                self._track(seq, token, special)
            if seq.budget is not None:
                seq.budget.accept(special)
        params = seq.request.params
        if llama.llama_vocab_is_eog(self._vocab, token):
            # llama-server checks the indentation at this token too (its text is empty); the
            # end-of-generation token then names the stop, the cut stays.
            cut = self._indent_cut(seq, b"") if seq.indent_text is not None else None
            self._finish(seq, "stop", "", flush=True, cut=cut)
            return
        piece = self._special_piece(token) if token in seq.preserved else self._piece(token)
        text, stopped = seq.stops.feed(seq.decoder.decode(piece))
        if stopped:
            self._finish(seq, "stop", text, flush=False)
            return
        # As llama-server's process_token: the indentation (of a line begun after an earlier
        # newline), then, at a token that sends a newline, the time since the first token.
        cut = self._indent_cut(seq, piece) if seq.indent_text is not None else None
        detail: Literal["", "indent", "time"] = "indent" if cut is not None else ""
        if "\n" in text:
            seq.has_new_line = True
            limit_ms = params.t_max_predict_ms
            if limit_ms is not None and limit_ms > 0 and time.perf_counter_ns() - seq.first_ns > limit_ms * 1_000_000:
                detail = "time"
        # The next step would decode this token at position n_past: is there room for it?
        limit = params.max_tokens
        ended = (limit is not None and seq.generated >= limit) or bool(detail)
        window = min(params.shift_window, self.n_ctx_seq)
        if not ended and window and seq.n_past >= window:
            self._shift_as_ollama(seq, window)
        elif not ended and seq.n_past + 1 >= self.n_ctx_seq and self.settings.context_shift and params.context_shift:
            self._shift(seq)
        if ended or seq.n_past >= self.n_ctx_seq:
            self._finish(seq, "length", text, flush=True, detail=detail, cut=cut)
            return
        seq.next_token = token
        if text:
            self._emit(seq, GenerateChunk(text=text, token_ids=seq.ids, logprobs=seq.logprobs,
                                          prompt_tokens=len(seq.prompt), cached_tokens=seq.cached))
            seq.ids = []
            seq.logprobs = []

    def _shift(self, seq: _Sequence) -> None:
        """llama-server's context shift (pre_decode), with its arithmetic so that a greedy
        generation goes on as there: keep the first `n_keep` cells (-1: the prompt; one more
        where the vocabulary adds a BOS, at most the slot's size - 4), drop the `n_discard`
        after them (0: half of the rest, at most all but one) and move the others back.
        Decoded at their new positions from then on, the output is no longer the one a slot
        without the shift would give; so is the cache the slot keeps (_free_sequence)."""
        params = seq.request.params
        n_keep = len(seq.prompt) if params.n_keep < 0 else params.n_keep
        n_keep = min(self.n_ctx_seq - 4, n_keep + int(self.adds_bos))
        n_left = seq.n_past - n_keep
        self._move(seq, n_keep, min(max(params.n_discard or n_left // 2, 0), max(0, n_left - 1)))

    def _shift_as_ollama(self, seq: _Sequence, window: int) -> None:
        """Ollama's context shift (its runner's InputCache.ShiftCacheSlot, read, not run here:
        no Ollama on the box), once the sequence holds `window` tokens: keep the first
        `n_keep` (-1: the prompt; at most window - 1; no BOS added, as its Go runner), drop
        enough after them that half of the rest of the window is free (at least one)."""
        n_keep = len(seq.prompt) if seq.request.params.n_keep < 0 else seq.request.params.n_keep
        n_keep = min(n_keep, window - 1)
        target_free = max((window - n_keep) // 2, 1)
        self._move(seq, n_keep, target_free - (window - seq.n_past))

    def _move(self, seq: _Sequence, n_keep: int, n_discard: int) -> None:
        """Drop the `n_discard` cells after the first `n_keep` and move the rest back."""
        llama.llama_memory_seq_rm(self._memory, seq.slot, n_keep, n_keep + n_discard)
        llama.llama_memory_seq_add(self._memory, seq.slot, n_keep + n_discard, seq.n_past, -n_discard)
        log.debug("model '%s' slot %d: context shift, n_keep %d, n_discard %d", self.name, seq.slot, n_keep, n_discard)
        seq.n_past -= n_discard
        seq.discarded += n_discard
        seq.kept = n_keep if seq.kept < 0 else min(seq.kept, n_keep)

    def _indent_cut(self, seq: _Sequence, piece: bytes) -> int | None:
        """GenerateParams.n_indent at one token, as llama-server's process_token checks it:
        None to go on, else the characters at the output's end a whole answer leaves out.

        Its slot looks at one line per token: the one after the newline its previous check
        found (none before the token after the first sent newline); a character other than
        a space or tab there after fewer than n_indent of them ends the output, and the line
        is cut after its indentation. Then the next newline after that line's start is found."""
        text = seq.indent_text
        assert text is not None
        text += piece
        if not seq.has_new_line:
            return None
        if seq.last_nl > 0:
            pos = seq.last_nl
            while pos < len(text) and text[pos] in b" \t":
                pos += 1
            if pos < len(text) and pos - seq.last_nl < seq.request.params.n_indent:
                return len(bytes(text[pos:]).decode("utf-8", errors="replace"))
        # Each check moves one newline on; what was searched without one is not read again.
        found = text.find(b"\n", max(seq.last_nl, seq.nl_scanned))
        seq.nl_scanned = len(text)
        if found >= 0:
            seq.last_nl = seq.nl_scanned = found + 1
        return None

    def _progress(self, seq: _Sequence) -> None:
        """A return_progress chunk: the prompt's tokens, of them cached at admission, in the
        cache now, and ms since admission (llama-server's prompt_progress)."""
        elapsed_ms = (time.perf_counter_ns() - seq.admitted_ns) // 1_000_000
        seq.request.emit(GenerateChunk(text="", prompt_progress=(len(seq.prompt), seq.cached, seq.n_past, elapsed_ms), slot=seq.slot))

    def _finish(
        self, seq: _Sequence, reason: Literal["stop", "length"], text: str, *, flush: bool,
        detail: Literal["", "indent", "time"] = "", cut: int | None = None,
    ) -> None:
        if flush:
            # The stream ends without a stop string: release what was held back (an
            # incomplete UTF-8 tail becomes U+FFFD, a partial stop match is plain text).
            tail, stopped = seq.stops.feed(seq.decoder.flush())
            text += tail if stopped else tail + seq.stops.flush()
        # Free first: once a client has its last chunk, its slot is already reusable.
        self._free_sequence(seq)
        self._emit(
            seq,
            GenerateChunk(
                text=text,
                token_ids=seq.ids,
                logprobs=seq.logprobs,
                finish_reason=reason,
                prompt_tokens=len(seq.prompt),
                completion_tokens=seq.generated,
                cached_tokens=seq.cached,
                # Past a shift the slot keeps only the cells no shift moved (_free_sequence).
                discarded_tokens=seq.n_past + seq.discarded - seq.kept if seq.kept >= 0 else 0,
                stop_word=seq.stops.matched,
                finish_detail=detail,
                cut=cut or 0,
            ),
        )

    def _free_sequence(self, seq: _Sequence, *, keep_cache: bool = True) -> None:
        """Give the slot back; its cells stay as the slot's prefix cache unless told not to."""
        if seq.first_ns:
            self._generation_ns += time.perf_counter_ns() - seq.first_ns
        if keep_cache and seq.kept >= 0 and llama.llama_memory_seq_rm(self._memory, seq.slot, seq.kept, -1):
            # Cells a shift moved were decoded at other positions than a fresh decode of
            # these tokens: a later request gets only the unmoved ones from the cache, so its
            # output is the same as without the cache.
            self._cached[seq.slot] = (seq.prompt + seq.decoded)[: seq.kept]
        elif keep_cache and seq.kept < 0:
            self._cached[seq.slot] = (seq.prompt + seq.decoded)[: seq.n_past]
        else:
            # Also after a shift of a recurrent state, which cannot be cut back to the unmoved
            # tokens (it holds all it was fed): nothing of it may serve as a prefix.
            llama.llama_memory_seq_rm(self._memory, seq.slot, -1, -1)
            self._cached[seq.slot] = []
        llama.llama_sampler_free(seq.sampler)
        if seq.grammar_chain is not None:
            llama.llama_sampler_free(seq.grammar_chain)
        self._slots[seq.slot] = None

    # --------------------------------------------------------------- slot files

    def _run_slot_jobs(self) -> None:
        """Each waiting action whose slot is idle, in arrival order; the rest keep waiting."""
        kept = []
        for job in self._slot_jobs:
            if job.cancelled:
                continue
            if self._slots[job.slot] is not None:
                kept.append(job)
                continue
            try:
                job.done(self._slot_action(job))
            except EdgedError as exc:
                job.done(exc)
            except Exception as exc:
                # A bug on one action: answer it (an unanswered job would hang its client) and
                # keep serving, with the slot emptied (its cells are unknown now).
                log.exception("slot %s of model '%s' failed", job.action, self.name)
                llama.llama_memory_seq_rm(self._memory, job.slot, -1, -1)
                self._cached[job.slot] = []
                job.done(BackendError(f"slot {job.action} failed on model '{self.name}': {type(exc).__name__}: {exc}"))
        self._slot_jobs = kept

    def _slot_action(self, job: SlotJob) -> tuple[int, int, float]:
        started = time.perf_counter()
        slot = job.slot
        cached = self._cached[slot]
        if job.action == "erase":
            llama.llama_memory_seq_rm(self._memory, slot, -1, -1)
            self._cached[slot] = []
            return len(cached), 0, 0.0
        file = job.path
        assert file is not None

        def reason(errors: list[str], default: str) -> str:
            # llama.cpp's reasons name the file by its path: the client gave only its name.
            said = "; ".join(errors).replace(str(file), file.name) if errors else default
            if "n_stream mismatch" in said:
                said += " (the file was saved by this model loaded with another n_parallel: the cache layout differs)"
            return said

        if job.action == "save":
            packed = [_PACKED_MARKER, _PACKED_VERSION, len(cached), *cached, 0]
            # Written beside it, then renamed over it: a restore (by this engine or by another
            # of the model, during a reload) reads the old file or the new one, never a part.
            temp = file.with_name(f".{file.name}.{os.getpid()}-{threading.get_ident()}.tmp")
            with _llama_errors() as errors:
                written = llama.llama_state_seq_save_file(
                    self._ctx, os.fsencode(temp), slot, (llama.llama_token * len(packed))(*packed), len(packed)
                )
            if written == 0:
                temp.unlink(missing_ok=True)
                said = reason([e.replace(str(temp), file.name) for e in errors], "llama.cpp failed")
                raise BackendError(f"Unable to save slot {slot} of model '{self.name}': {said}")
            try:
                os.replace(temp, file)
            except OSError as exc:
                temp.unlink(missing_ok=True)
                raise BackendError(f"Unable to save slot {slot} of model '{self.name}': {exc.strerror}") from None
            return len(cached), written, (time.perf_counter() - started) * 1000
        if not file.is_file():
            raise InvalidArgument(f"Unable to restore slot {slot}: no file {file.name!r} in the model's slot_save_path")
        # Read here, not by llama_state_seq_load_file: on a file cut short its reader runs past
        # the end and aborts the process (GGML_ASSERT(nread <= state_size)), where the reader
        # of a buffer stops at its end and fails. The file: magic, version, the token count,
        # the tokens, then the sequence's state, which a buffer for llama_state_seq_set_data
        # holds after a header of its own. Read, not mapped: a file mapped while another
        # engine of the model (a reload) or an operator rewrites it in place raised SIGBUS.
        with open(file, "rb") as handle:
            size = os.fstat(handle.fileno()).st_size
            head = handle.read(_SLOT_HEADER.size)
            if len(head) < _SLOT_HEADER.size:
                raise InvalidArgument(f"Unable to restore slot {slot}: not a slot file (it has {len(head)} bytes)")
            magic, version, n_tokens = _SLOT_HEADER.unpack(head)
            if (magic, version) != (llama.LLAMA_STATE_SEQ_MAGIC, llama.LLAMA_STATE_SEQ_VERSION):
                raise InvalidArgument(
                    f"Unable to restore slot {slot}: unknown (magic, version) for sequence state file: "
                    f"{magic:08x}, {version:08x}"
                )
            start = _SLOT_HEADER.size + 4 * n_tokens
            listed = array("i", handle.read(4 * n_tokens) if start <= size else b"")
            if len(listed) != n_tokens:
                raise InvalidArgument(f"Unable to restore slot {slot}: the file is cut short in its token list")
            state = (ctypes.c_uint8 * (size - start + 8))()  # start <= size: the tokens were read
            got = handle.readinto(memoryview(state).cast("B")[8:])
            if got != len(state) - 8:
                raise InvalidArgument(f"Unable to restore slot {slot}: the file changed while it was read")
        # The slot's cells are about to be replaced: they may be a conversation that comes back.
        if cached:
            self._save(slot, cached)
        llama.llama_memory_seq_rm(self._memory, slot, -1, -1)
        self._cached[slot] = []
        state[:8] = self._state_header(slot)
        with _llama_errors() as errors:
            read = llama.llama_state_seq_set_data(self._ctx, state, len(state), slot)
        del state
        try:
            if read == 0:
                raise ValueError(reason(errors, "its cells do not fit this model's slot"))
            read += start - 8  # llama-server counts the file's header and tokens, not the buffer's
            tokens = _unpacked(list(listed))
            if len(tokens) > self.n_ctx_seq:
                raise ValueError(f"its {len(tokens)} tokens do not fit the slot's {self.n_ctx_seq}")
            if any(not 0 <= t < self.n_vocab for t in tokens):
                raise ValueError(f"it holds token ids outside this model's vocabulary of {self.n_vocab}")
            # The cache reads a slot's tokens as its cells, one for one from position 0: a file
            # whose lists disagree would decode the next prompt against the wrong cells.
            cells = llama.llama_memory_seq_pos_max(self._memory, slot) + 1
            if cells != len(tokens):
                raise ValueError(f"it holds {len(tokens)} tokens for {cells} KV cells")
        except ValueError as exc:
            llama.llama_memory_seq_rm(self._memory, slot, -1, -1)
            raise InvalidArgument(f"Unable to restore slot {slot}: {exc}") from None
        self._cached[slot] = tokens
        # A slot file does not say which scales its cells were decoded with (nor does
        # llama-server's): the model's current ones.
        self._cached_lora[slot] = _f32(self._lora_defaults)
        return len(tokens), read, (time.perf_counter() - started) * 1000

    def _state_header(self, slot: int) -> bytes:
        """The header llama_state_seq_get_data writes before a sequence's state (llama.cpp's
        magic for such buffers, then the sequence id), read from `slot` while it is empty."""
        size = llama.llama_state_seq_get_size(self._ctx, slot)
        buffer = (ctypes.c_uint8 * size)()
        if size < 8 or llama.llama_state_seq_get_data(self._ctx, buffer, size, slot) < 8:
            raise BackendError(f"model '{self.name}': llama.cpp wrote no sequence state header")
        return bytes(buffer[:8])

    # --------------------------------------------------------------- embeddings

    def _embed(self, job: EmbedJob) -> None:
        if job.cancelled:
            return
        try:
            if isinstance(job, RerankJob):
                job.done(self._rerank(job.query, job.texts))  # type: ignore[arg-type]
            else:
                job.done(self._embed_texts(job.texts, job.truncate))
        except EdgedError as exc:
            job.done(exc)
        except Exception as exc:
            # A bug on one request's inputs: answer it (a job left unanswered would hang its
            # client) and keep serving; each embedding batch starts from cleared cells.
            kind = "rerank" if isinstance(job, RerankJob) else "embedding"
            log.exception("%s request on model '%s' failed", kind, self.name)
            job.done(BackendError(f"{kind} failed on model '{self.name}': {type(exc).__name__}: {exc}"))

    def _embed_texts(self, texts: list[str | list[int]], truncate: bool = False) -> tuple[list[list[float]], int]:
        if not self.settings.embedding:
            raise InvalidArgument(
                f"model '{self.name}' is not loaded as an embedding model; "
                "set parameters embedding=true in its config"
            )
        if self.reranker:
            raise InvalidArgument(
                f"model '{self.name}' is a reranker (its GGUF's pooling is rank): it scores documents "
                "against a query (POST /rerank), it computes no embeddings"
            )
        limit = min(self._n_batch, self.n_ctx_seq)
        tokenized = []
        for index, text in enumerate(texts):
            if isinstance(text, str):
                tokens = self._tokenize(text)
                if len(tokens) > limit and truncate:
                    tokens = self._truncated(tokens, limit)
            else:
                tokens = self._checked_ids(index, text)
                if truncate:  # nothing was appended to ids given as they are: a plain cut
                    tokens = tokens[:limit]
            if len(tokens) > limit:
                raise InvalidArgument(
                    f"input[{index}] is {len(tokens)} tokens but model '{self.name}' embeds at "
                    f"most {limit} tokens per input (n_batch)"
                )
            tokenized.append(tokens)
        vectors: list[list[float]] = []
        for group in self._packed(tokenized):
            for vector in self._pooled_batch(group, self.n_embd):
                # L2-normalised, as OpenAI's embeddings and llama-server's default are.
                norm = float(np.linalg.norm(vector))
                vectors.append((vector / norm if norm > 0 else vector).tolist())
        return vectors, sum(len(t) for t in tokenized)

    def _rerank(self, query: str, documents: list[str]) -> tuple[list[float], int]:
        if not self.reranker:
            kind = "an embedding model" if self.settings.embedding else "a text generation model"
            raise InvalidArgument(
                f"model '{self.name}' is not a reranker: it is {kind}; /rerank takes a GGUF whose "
                "pooling is rank (a classifier head, such as a Qwen3 or BGE reranker), loaded with "
                "parameters embedding=true"
            )
        limit = min(self._n_batch, self.n_ctx_seq)
        prompts = []
        for index, document in enumerate(documents):
            tokens = self._rerank_tokens(query, document)
            if not tokens:  # an empty query and document with nothing added around them
                raise InvalidArgument(f"documents[{index}]: no tokens to score (an empty query and document)")
            if len(tokens) > limit:
                raise InvalidArgument(
                    f"documents[{index}]: the query and document are {len(tokens)} tokens but model "
                    f"'{self.name}' scores at most {limit} tokens at once (n_batch)"
                )
            prompts.append(tokens)
        scores: list[float] = []
        for group in self._packed(prompts):
            # llama-server's score: the first output of the head (Qwen3's "yes" probability).
            scores.extend(float(out[0]) for out in self._pooled_batch(group, self._n_cls_out))
        return scores, sum(len(t) for t in prompts)

    def _rerank_tokens(self, query: str, document: str) -> list[int]:
        """llama-server's format_prompt_rerank: the GGUF's rerank template with {query} and
        {document} replaced, tokenized with control tokens parsed and no BOS added; without
        one, [BOS] query [EOS] [SEP] document [EOS] (each where the vocabulary adds it; EOS
        falls back to SEP), query and document tokenized as plain text."""
        if self._rerank_template is not None:
            prompt = self._rerank_template.replace("{query}", query).replace("{document}", document)
            return self._tokenize(prompt, add_special=False, parse_special=True)
        vocab = self._vocab
        eos = llama.llama_vocab_eos(vocab)
        if eos < 0:
            eos = llama.llama_vocab_sep(vocab)
        add_eos = bool(llama.llama_vocab_get_add_eos(vocab))
        tokens: list[int] = []
        if llama.llama_vocab_get_add_bos(vocab):
            tokens.append(llama.llama_vocab_bos(vocab))
        tokens += self._tokenize(query, add_special=False, parse_special=False)
        if add_eos:
            tokens.append(eos)
        if llama.llama_vocab_get_add_sep(vocab):
            tokens.append(llama.llama_vocab_sep(vocab))
        tokens += self._tokenize(document, add_special=False, parse_special=False)
        if add_eos:
            tokens.append(eos)
        return tokens

    def _packed(self, tokenized: list[list[int]]) -> Iterator[list[list[int]]]:
        """Whole inputs packed into batches, one sequence each, at most one per slot."""
        start = 0
        while start < len(tokenized):
            end, used = start, 0
            while (
                end < len(tokenized)
                and end - start < self.settings.n_parallel
                and used + len(tokenized[end]) <= self._n_batch
            ):
                used += len(tokenized[end])
                end += 1
            yield tokenized[start:end]
            start = end

    def _checked_ids(self, index: int, tokens: list[int]) -> list[int]:
        """Token ids to embed as given (llama-server adds no BOS/EOS to token input either);
        an id outside the vocabulary would have llama.cpp read out of bounds."""
        if not tokens:
            raise InvalidArgument(f"input[{index}]: an empty list of token ids has nothing to embed")
        for position, token in enumerate(tokens):
            if not 0 <= token < self.n_vocab:
                raise InvalidArgument(
                    f"input[{index}][{position}]: token id {token} is out of range (vocabulary {self.n_vocab})"
                )
        return tokens

    def _truncated(self, tokens: list[int], limit: int) -> list[int]:
        """The first `limit` tokens (Ollama's `truncate`), keeping the end token the tokenizer
        appends (EOS, or SEP on BERT-style vocabularies): the pooled embedding is the model's
        for a text of that length, as if the text had been shorter."""
        appended = {
            token
            for adds, token in (
                (llama.llama_vocab_get_add_eos(self._vocab), llama.llama_vocab_eos(self._vocab)),
                (llama.llama_vocab_get_add_sep(self._vocab), llama.llama_vocab_sep(self._vocab)),
            )
            if adds and token >= 0
        }
        if tokens and tokens[-1] in appended:
            return [*tokens[: limit - 1], tokens[-1]]
        return tokens[:limit]

    def _pooled_batch(self, group: list[list[int]], width: int) -> list[np.ndarray]:
        """Each input's pooled output, `width` floats (n_embd, or a reranker's n_cls_out)."""
        batch = self._batch
        n = 0
        for seq_id, tokens in enumerate(group):
            for pos, token in enumerate(tokens):
                batch.token[n] = token
                batch.pos[n] = pos
                batch.n_seq_id[n] = 1
                batch.seq_id[n][0] = seq_id
                batch.logits[n] = True
                n += 1
        batch.n_tokens = n
        encoder_only = llama.llama_model_has_encoder(self._model) and not llama.llama_model_has_decoder(self._model)
        self._apply_lora(_f32(self._lora_defaults))
        try:
            started = time.perf_counter_ns()
            status = (llama.llama_encode if encoder_only else llama.llama_decode)(self._ctx, batch)
            if status != 0:
                raise BackendError(f"llama.cpp failed to embed for model '{self.name}' (status {status})")
            # llama-server's llamacpp:* counters count these decodes too: each input is a
            # prompt in a slot of its own, evaluated whole.
            self._prompt_ns += time.perf_counter_ns() - started
            self._prompt_evaluated += n
            self._decodes += 1
            self._busy_decoding += len(group)
            self._n_tokens_max = max(self._n_tokens_max, *(len(tokens) for tokens in group))
            vectors = []
            for seq_id in range(len(group)):
                pointer = llama.llama_get_embeddings_seq(self._ctx, seq_id)
                if not pointer:
                    raise BackendError(f"llama.cpp returned no pooled embedding for model '{self.name}'")
                vector = np.ctypeslib.as_array(pointer, shape=(width,)).astype(np.float64)
                if not np.isfinite(vector).all():
                    # JSON has no NaN: written, it would be null, which the model did not say.
                    raise BackendError(f"model '{self.name}' computed an output that is not numbers (NaN or infinite)")
                vectors.append(vector)
            return vectors
        finally:
            if self._memory:
                llama.llama_memory_clear(self._memory, True)

    # --------------------------------------------------------------- text

    def tokenize(self, text: str, *, add_special: bool, parse_special: bool) -> list[int]:
        """`text`'s token ids, from any thread (llama-server's /tokenize): the vocabulary is
        read-only once loaded, and llama-server tokenizes on its HTTP threads too."""
        with self._vocab_lock:
            self._require_model()
            return self._tokenize(text, add_special=add_special, parse_special=parse_special)

    def token_pieces(self, tokens: Sequence[int]) -> list[bytes]:
        """Each token's bytes, control tokens' text included, from any thread (a buffer of its
        own: `_piece_buf` is the engine thread's)."""
        with self._vocab_lock:
            self._require_model()
            bad = next((t for t in tokens if not 0 <= t < self.n_vocab), None)
            if bad is not None:
                raise InvalidArgument(
                    f"token id {bad} is out of range for model '{self.name}' (vocabulary of {self.n_vocab} tokens)"
                )
            buffer = ctypes.create_string_buffer(64)
            return [self._to_piece(token, special=True, buffer=buffer) for token in tokens]

    def infill_tokens(self, infill: InfillInput) -> list[int]:
        """llama-server's /infill prompt (its format_prompt_infill, with its default n_predict
        of -1), from any thread: the extra files first, as many of their last tokens as fit
        in the context beyond one batch; then [BOS] FIM_PRE, the prefix's last 3/4 batch of
        tokens, the prompt, FIM_SUF, the suffix's first tokens up to a 1/4 batch, FIM_MID.
        Where the model has FIM_REP and FIM_SEP, the extra part is the repository-level
        layout: FIM_REP "myproject\n", FIM_SEP "<filename>\n" before each file's text and
        FIM_SEP "filename\n" after them; else the files' texts between snippet markers."""
        with self._vocab_lock:
            self._require_model()
            vocab = self._vocab
            pre, suf, mid = llama.llama_vocab_fim_pre(vocab), llama.llama_vocab_fim_suf(vocab), llama.llama_vocab_fim_mid(vocab)
            if min(pre, suf, mid) < 0:
                raise InvalidArgument(
                    f"model '{self.name}' has no fill-in-the-middle tokens (FIM prefix/suffix/middle)"
                )
            rep, sep = llama.llama_vocab_fim_rep(vocab), llama.llama_vocab_fim_sep(vocab)

            def text(value: str) -> list[int]:
                return self._tokenize(value, add_special=False, parse_special=False)

            extra: list[int] = [rep, *text("myproject\n")] if rep >= 0 else []
            for filename, chunk in infill.extra:
                extra += [sep, *text(filename + "\n")] if sep >= 0 else text("\n\n--- snippet ---\n\n")
                extra += text(chunk)
            if sep >= 0:
                extra += [sep, *text("filename\n")]
            prefix, suffix = text(infill.prefix), text(infill.suffix)
            prompt = self._tokenize(infill.prompt, add_special=False, parse_special=True)
            quarter = self._n_batch // 4
            n_prefix = min(len(prefix), 3 * quarter)
            n_suffix = min(len(suffix), max(0, quarter - (2 + len(prompt))))
            n_extra = min(max(0, self.n_ctx_seq - self._n_batch + 2), len(extra))
            bos = llama.llama_vocab_bos(vocab)
            head = [bos] if self.adds_bos else []
            return [
                *extra[len(extra) - n_extra :], *head, pre, *prefix[len(prefix) - n_prefix :], *prompt,
                suf, *suffix[:n_suffix], mid,
            ]

    def _require_model(self) -> None:
        if not self._model:
            raise Unavailable(f"model '{self.name}' is not loaded")

    def _tokenize(self, text: str, *, add_special: bool = True, parse_special: bool = True) -> list[int]:
        data = text.encode("utf-8", errors="replace")
        capacity = len(data) + 8
        buffer = (llama.llama_token * capacity)()
        count = llama.llama_tokenize(self._vocab, data, len(data), buffer, capacity, add_special, parse_special)
        if count < 0 and count != -(2**31):
            capacity = -count
            buffer = (llama.llama_token * capacity)()
            count = llama.llama_tokenize(self._vocab, data, len(data), buffer, capacity, add_special, parse_special)
        if count < 0:
            raise InvalidArgument(f"prompt of {len(data)} bytes is too long to tokenize")
        return buffer[:count]  # a slice of a ctypes array is a new list

    def _preserved(self, frame: ToolCallFrame | None) -> frozenset[int]:
        """Control tokens that spell a tool-call frame's markers (Mistral's `[TOOL_CALLS]`):
        the grammar matches them by their text, and the routes read the calls by it, but
        control tokens detokenize to nothing. As llama-server's preserved tokens, their text
        stays in this request's output; other control tokens still write nothing."""
        if frame is None:
            return frozenset()
        # Gemma 4's string marks are control tokens of its vocabulary too.
        quote = GEMMA_QUOTE if frame.arguments_syntax == "gemma" else ""
        return self._control_tokens((frame.open, frame.separator, frame.close, frame.args_marker, frame.id_marker, quote))

    def _control_tokens(self, markers: Sequence[str]) -> frozenset[int]:
        """The control tokens (text only with `special`) that the markers tokenize to."""
        return frozenset(
            token
            for marker in markers
            if marker
            for token in self._tokenize(marker, add_special=False)
            if not self._piece(token) and self._special_piece(token)
        )

    def _special_piece(self, token: int) -> bytes:
        """The token's text also for a control token (not cached: only preserved markers)."""
        return self._to_piece(token, special=True)

    def _piece(self, token: int) -> bytes:
        piece = self._pieces.get(token)
        if piece is None:
            piece = self._pieces[token] = self._to_piece(token, special=False)
        return piece

    def _to_piece(self, token: int, *, special: bool, buffer: Any = None) -> bytes:
        """`buffer`: another thread's own (`_piece_buf` is the engine thread's)."""
        buffer = self._piece_buf if buffer is None else buffer
        size = llama.llama_token_to_piece(self._vocab, token, buffer, len(buffer), 0, special)
        if size < 0:
            buffer = ctypes.create_string_buffer(-size)
            size = llama.llama_token_to_piece(self._vocab, token, buffer, len(buffer), 0, special)
        return buffer.raw[:size]

    # --------------------------------------------------------------- teardown

    def _fail(self, seq: _Sequence, error: EdgedError, *, keep_cache: bool = True) -> None:
        """End `seq` alone with `error`; its slot keeps what was decoded as cache unless told not to."""
        self._free_sequence(seq, keep_cache=keep_cache)
        seq.request.emit(error)

    def _fail_all(self, error: EdgedError) -> None:
        for seq in self._slots:
            if seq is not None:
                # The failed decode may have left any cells of it: keep none as cache.
                self._fail(seq, error, keep_cache=False)

    def _nan_logits(self, written: str) -> _SequenceFailed:
        """The failure of a sequence whose logits are NaN or infinite, where it would write
        their `written` (logprobs, probabilities). JSON has no NaN: msgspec writes it as null,
        a value the model did not compute (a LoRA scaled to 1e30 overflows, as can fp16)."""
        return _SequenceFailed(BackendError(
            f"model '{self.name}' computed logits that are not numbers (NaN or infinite): "
            f"their {written} cannot be written"
        ))

    def _shutdown(self) -> None:
        for seq in self._slots:
            if seq is not None:
                tail = seq.stops.flush()
                seq.request.emit(
                    GenerateChunk(
                        text=tail, token_ids=seq.ids, finish_reason="cancelled",
                        prompt_tokens=len(seq.prompt), completion_tokens=seq.generated, slot=seq.slot,
                    )
                )
                self._free_sequence(seq)
        with self._cond:
            self._stopping = True
            leftovers: list[Request | EmbedJob | SlotJob] = [item.request for item in self._waiting]
            leftovers.extend(self._slot_jobs)
            self._slot_jobs = []
            for prepared in self._waiting:
                if prepared.grammar:
                    llama.llama_sampler_free(prepared.grammar)
            leftovers.extend(self._inbox)
            self._inbox.clear()
            self._waiting.clear()
            self._pending = 0
        gone: EdgedError = (
            BackendError(self._failure)
            if self._failure
            else Unavailable(f"model '{self.name}' was unloaded before the request started")
        )
        for item in leftovers:
            if isinstance(item, (EmbedJob, SlotJob)):
                item.done(gone)
            else:
                item.emit(gone)
        self._free()

    def _free(self) -> None:
        if self._batch is not None:
            llama.llama_batch_free(self._batch)
            self._batch = None
        if self._ctx:
            llama.llama_free(self._ctx)
        self._ctx = None
        # Not while another thread tokenizes with the model's vocabulary (tokenize, token_pieces).
        with self._vocab_lock:
            if self._model:
                llama.llama_model_free(self._model)
            self._model = None


def _reuse_plan(cached: list[int], tokens: list[int], common: int, size: int) -> list[tuple[int, int, int]]:
    """The runs llama-server's cache reuse moves (its server-context.cpp, read, not copied),
    as (position in the cache, position in the prompt, length): after the `common` prefix,
    the prompt's next `size` tokens are looked for in the cache from where the last run
    ended; found, that run (as long as the two go on alike) moves there and the prompt goes on
    after it; not found, nothing more moves. The ids are searched as bytes (bytes.find, C)
    rather than cell by cell in Python, which a cache of thousands of cells would make slow
    on the engine's thread (llama-server's loop is C++)."""
    haystack = array("i", cached).tobytes()
    plan = []
    at_c = at_p = common
    while at_c < len(cached) and at_p + size <= len(tokens):
        needle = array("i", tokens[at_p : at_p + size]).tobytes()
        found = haystack.find(needle, at_c * 4)
        while found >= 0 and found % 4:  # a match that straddles two ids is none
            found = haystack.find(needle, found + 1)
        if found < 0:
            break
        at_c, run = found // 4, size
        while at_c + run < len(cached) and at_p + run < len(tokens) and cached[at_c + run] == tokens[at_p + run]:
            run += 1
        plan.append((at_c, at_p, run))
        at_c += run
        at_p += run
    return plan


def _unpacked(packed: list[int]) -> list[int]:
    """The tokens of a slot file as llama-server packs them (or bare, as its older files)."""
    if not packed or packed[0] != _PACKED_MARKER:
        return packed
    if len(packed) < 3 or packed[1] != _PACKED_VERSION:
        raise ValueError("an unknown version of llama-server's slot file")
    count = packed[2]
    if count < 0 or len(packed) != 3 + count + 1:
        raise ValueError("its token list is cut or has trailing data")
    if packed[3 + count] != 0:
        raise ValueError("it holds media (images or audio), which this model does not take")
    return packed[3 : 3 + count]


def _utf8_need(need: int, piece: bytes) -> int:
    """How many continuation bytes the last UTF-8 character lacks after `piece`, `need`
    before it (a byte that cannot continue or start one ends the count: nothing to wait for)."""
    for byte in piece:
        if 0x80 <= byte <= 0xBF:
            need = max(need - 1, 0)
        else:
            need = 1 if 0xC0 <= byte <= 0xDF else 2 if 0xE0 <= byte <= 0xEF else 3 if 0xF0 <= byte <= 0xF7 else 0
    return need


def _ending_trigger(params: GenerateParams) -> str:
    """The tool frame's trigger where it also ends the reasoning (ToolCallFrame.ends_reasoning),
    else ""."""
    frame = params.tool_calls
    return trigger_core(frame) if frame is not None and frame.ends_reasoning else ""


def _is_lazy_frame(params: GenerateParams) -> bool:
    return params.tool_calls is not None and params.tool_calls.lazy


def _f32(values: Sequence[float]) -> tuple[float, ...]:
    """LoRA scales as llama.cpp holds them (float): the values compared and applied."""
    return tuple(ctypes.c_float(v).value for v in values)


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the common prefix. Slices compare at C speed: a 2 000-token prompt costs
    ~10 us instead of ~65 us for a Python loop over it."""
    if type(a) is not type(b):  # a stored prefix (tuple) against a prompt (list)
        a, b = list(a), list(b)
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    i, block = 0, 256
    while a[i : i + block] == b[i : i + block]:  # stops at the block holding the difference
        i += block
    while a[i] == b[i]:
        i += 1
    return i


def _adapter_meta(adapter: Any, key: bytes) -> str:
    """A LoRA adapter's metadata text ("" when the GGUF has no such key)."""
    buffer = ctypes.create_string_buffer(1024)
    if llama.llama_adapter_meta_val_str(adapter, key, buffer, len(buffer)) < 0:
        return ""
    return buffer.value.decode("utf-8", errors="replace")


def _log_sink() -> threading.local:
    """Where the log callback also puts llama.cpp's errors for the thread that asked
    (`_llama_errors`); pinned on the llama_cpp module beside the callback."""
    sink = getattr(llama, "_edged_log_sink", None)
    if sink is None:
        sink = threading.local()
        llama._edged_log_sink = sink  # type: ignore[attr-defined]
    return sink


@contextlib.contextmanager
def _llama_errors() -> Iterator[list[str]]:
    """The error lines llama.cpp logs on this thread meanwhile (a failed call's reason),
    without the name of the function that logged each."""
    sink = _log_sink()
    lines: list[str] = []
    sink.errors = lines
    try:
        yield lines
    finally:
        sink.errors = None


def _parsed(name: str, make: Callable[[], Any]) -> Any:
    """A grammar sampler from `make`, or an InvalidArgument naming the field `name` with llama.cpp's
    reason where its log gave one beyond "failed to parse grammar" (left recursion, no root
    rule); its parser writes the other reasons to stderr only, so the daemon's log has them."""
    with _llama_errors() as errors:
        grammar = make()
    if grammar:
        return grammar
    reasons = [line for line in errors if line and line != "failed to parse grammar"]
    why = ": " + "; ".join(reasons) if reasons else " (the daemon log has why)"
    raise InvalidArgument(f"{name}: llama.cpp could not parse {'their grammar' if name == 'tool_calls' else 'it'}{why}")


def install_log_callback() -> None:
    """Route llama.cpp's warnings and errors into Python logging, once per process.

    llama-cpp-python prints every llama.cpp log line to stderr by default. The callback must
    outlive every model (llama.cpp keeps the raw pointer), and this plugin's modules can be
    reloaded, so it is pinned on the llama_cpp module itself rather than on ours.
    """
    if getattr(llama, "_edged_log_callback", None) is not None:
        return
    runtime_log = logging.getLogger("edged_backends.llamacpp.runtime")
    sink = _log_sink()

    @llama.llama_log_callback
    def callback(level: int, text: bytes | None, user_data: ctypes.c_void_p) -> None:
        if text and level in (_GGML_LOG_WARN, _GGML_LOG_ERROR):
            line = text.decode("utf-8", errors="replace").rstrip()
            runtime_log.log(logging.WARNING if level == _GGML_LOG_WARN else logging.ERROR, "%s", line)
            errors = getattr(sink, "errors", None)
            if errors is not None and level == _GGML_LOG_ERROR:
                errors.append(_FUNCTION_PREFIX.sub("", line))

    llama._edged_log_callback = callback  # type: ignore[attr-defined]
    llama.llama_log_set(callback, ctypes.c_void_p(0))


def _owning_chain(grammar: Any) -> Any:
    """A sampler chain holding `grammar` alone (None for none): it owns and frees it."""
    if grammar is None:
        return None
    chain = llama.llama_sampler_chain_init(llama.llama_sampler_chain_default_params())
    llama.llama_sampler_chain_add(chain, grammar)
    return chain
