"""llama.cpp backend: GGUF models for text generation (continuous batching) and embeddings.

The engine (engine.py) runs on its own thread and owns every llama.cpp object; this class
parses the model's parameters, starts and stops the engine, and adapts it to asyncio: each
request gets an asyncio.Queue that the engine fills through the backend's Outbox (outbox.py).

Model parameters (config `parameters`, all strings):

    n_ctx         total KV cache tokens, split evenly across the slots like llama-server's
                  `-c`; llama.cpp rounds each slot up to a multiple of 256.
                  Default: min(trained context, 4096) per slot.
    n_parallel    slots = sequences decoded together (default 4)
    n_batch       tokens per llama_decode step, prompt chunks included (default 512)
    n_threads     CPU threads (default: the daemon's share for this instance)
    n_gpu_layers  layers offloaded to the GPU; default all on a GPU device, none on CPU
    chat_template Jinja template text, or a llama.cpp built-in template name ("chatml",
                  "llama3", ...); default the GGUF's Jinja template (see templates.py)
    embedding     "true": an embedding model (serves embed(), not generate()); a GGUF whose
                  pooling is rank (a reranker) serves rerank() instead
    pooling       mean | cls | last; default the GGUF's pooling, else mean
    max_queue     requests that may wait for a slot before new ones get 503 (default 64)
    flash_attn    auto | on | off; default llama.cpp's auto (on for the CPU too)
    prefix_store_mib  host RAM (MiB) for the KV cells of conversations a new one pushed out
                  of their slot, restored when they return; 0 turns it off. Default:
                  llama-server's (`--cache-ram 8192`), at most an eighth of the machine's
                  memory (an edge box's RAM is also its model's)
    lora          LoRA adapter GGUFs applied to every sequence (llama-server's `--lora` and
                  `--lora-scaled`): comma-separated, each `path` or `path:scale` (default
                  1.0), a path relative to the model's version directory (or absolute).
                  Loaded with the model; a missing file, a file that is no LoRA adapter, one
                  for another architecture or shape, or an activated LoRA (aLoRA) fails the
                  load naming this parameter and the file. Their ids are their order
                  (GET /lora-adapters). These are the scales a request that names none
                  gets: a request's `lora` gives its own, POST /lora-adapters the model's
                  until it reloads; sequences with other scales take turns in the decode
    context_shift "true": llama-server's `--context-shift` (off there too by default): a
                  generation that fills its slot's context drops older tokens and goes on
                  (a request's `n_keep` and `n_discard` say which); off, it ends with
                  finish_reason "length" and those fields are a 400. A model llama.cpp
                  cannot shift fails its load naming this parameter
    cache_reuse   llama-server's `--cache-reuse` (0, off, by default there too): the
                  smallest run of a slot's cached tokens that a new prompt has further on
                  (after the prefix they share) which is moved there rather than decoded
                  again; a request's `n_cache_reuse` overrides it. The moved cells keep
                  what was computed after their old prefix, so the output is close to a
                  cold decode's, not the same (why it is off unless asked for). A model
                  whose memory is a recurrent state (Mamba, RWKV) has no cells to move: it
                  fails its load naming this parameter
    slot_save_path  a directory for llama-server's slot files (its `--slot-save-path`):
                  POST /slots/{id}?action=save|restore writes and reads them there. A
                  relative path is under the model version's state directory (slot files
                  hold KV cells, which only this version's weights can use); created at
                  load. Default none: save and restore are refused (erase works without)
"""

from __future__ import annotations

import asyncio
import math
import os
from collections.abc import AsyncGenerator, Callable, Mapping, Sequence
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal, TypeVar

import msgspec

from daemon.backend import (
    SAMPLERS,
    Capabilities,
    ConfigError,
    Device,
    EdgedError,
    GenerateChunk,
    GenerateParams,
    GenerationBackend,
    GenerationProps,
    InfillInput,
    InstanceContext,
    InvalidArgument,
    LoraAdapter,
    ModelConfig,
    Probe,
    SlotAction,
    SlotFile,
    SlotState,
    Unavailable,
    Unsupported,
    lora_entries,
)

from .engine import EmbedJob, Engine, EngineSettings, LoraSpec, SlotJob, install_log_callback
from .ggml_backends import load_backends
from .grammar import check_grammar, schema_to_grammar, tool_call_grammar
from .outbox import Outbox

T = TypeVar("T")


INT32_MAX = 2**31 - 1


class LlamaCppOptions(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """The model's `parameters`, validated (strings are converted: "8" -> 8, "true" -> True)."""

    # Upper bounds are what llama.cpp's C types hold (positions are int32; GGML_MAX_N_THREADS
    # is 512): ctypes keeps only the low bits of a larger value, so n_ctx 2**40 loaded with
    # the model's default and n_batch 2**32+1 became 1 and tripped a GGML_ASSERT that ended
    # the process.
    n_ctx: Annotated[int, msgspec.Meta(ge=0, le=INT32_MAX)] = 0
    n_parallel: Annotated[int, msgspec.Meta(ge=1, le=256)] = 4
    n_batch: Annotated[int, msgspec.Meta(ge=1, le=INT32_MAX)] = 512
    n_threads: Annotated[int, msgspec.Meta(ge=0, le=512)] = 0
    n_gpu_layers: Annotated[int, msgspec.Meta(ge=-1, le=INT32_MAX)] | None = None
    chat_template: str = ""
    embedding: bool = False
    pooling: Literal["", "mean", "cls", "last"] = ""
    max_queue: Annotated[int, msgspec.Meta(ge=1)] = 64
    flash_attn: Literal["", "auto", "on", "off"] = ""
    prefix_store_mib: Annotated[int, msgspec.Meta(ge=0)] | None = None
    lora: str = ""
    slot_save_path: str = ""
    context_shift: bool = False
    cache_reuse: Annotated[int, msgspec.Meta(ge=0)] = 0

    def __post_init__(self) -> None:
        if self.n_batch < self.n_parallel:
            # Every generating slot puts one token into each step's batch.
            raise ValueError(f"n_batch ({self.n_batch}) must be >= n_parallel ({self.n_parallel})")


# llama-server's host-RAM prompt cache is on by default (`--cache-ram 8192`, MiB): a
# conversation that another pushed out of its slot comes back without its prompt being
# decoded again. Clients tuned against it expect that.
LLAMA_SERVER_CACHE_RAM_MIB = 8192


def default_prefix_store_mib() -> int:
    """llama-server's budget, capped at an eighth of physical memory: the cap only holds
    what is stored, but on a small box the model and its KV cache need the rest."""
    try:
        physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):  # no such sysconf name here: keep llama-server's
        return LLAMA_SERVER_CACHE_RAM_MIB
    return min(LLAMA_SERVER_CACHE_RAM_MIB, physical // 8 // 2**20)


def parse_lora(config: ModelConfig, text: str, version_dir: Path) -> tuple[LoraSpec, ...]:
    """The `lora` parameter's adapters: `path[:scale],...`, paths from the version directory."""
    specs = []
    for index, (name, given) in enumerate(lora_entries(text)):
        scale = 1.0
        if given is not None:
            try:
                scale = float(given)
            except ValueError:
                scale = math.nan
            if not math.isfinite(scale):
                raise ConfigError(
                    f"model '{config.name}': parameters lora: adapter {index} ({name + ':' + given!r}): the scale "
                    f"after ':' must be a number, got {given!r}"
                )
        if not name:
            raise ConfigError(f"model '{config.name}': parameters lora: adapter {index} has no path (got {text!r})")
        specs.append(LoraSpec(name=name, path=version_dir / name, scale=scale))
    return tuple(specs)


def parse_options(config: ModelConfig) -> LlamaCppOptions:
    try:
        return msgspec.convert(config.parameters, LlamaCppOptions, strict=False)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"model '{config.name}': invalid llamacpp parameters: {exc}") from None


class LlamaCppBackend(GenerationBackend):
    name: ClassVar[str] = "llamacpp"
    capabilities: ClassVar[Capabilities] = Capabilities(
        kind="generation",
        dynamic_batching=False,
        decoupled=True,
        datatypes=frozenset({"BYTES"}),
    )

    def __init__(self, context: InstanceContext) -> None:
        super().__init__(context)
        self._engine: Engine | None = None
        self._slot_dir: Path | None = None
        # The engine thread's results to the event loop; made at load, on the loop's thread.
        self._outbox: Outbox | None = None

    @classmethod
    def probe(cls) -> Probe:
        try:
            import llama_cpp
            import llama_cpp.llama_cpp as llama
        except Exception as exc:  # a broken native build raises OSError, not ImportError
            return Probe(available=False, reason=f"cannot import llama_cpp: {type(exc).__name__}: {exc}")
        install_log_callback()  # ggml's line per library loaded goes to logging, not stderr
        try:
            cpu = load_backends()
        except (OSError, RuntimeError) as exc:
            return Probe(available=False, reason=str(exc))
        gpu = bool(llama.llama_supports_gpu_offload())
        return Probe(
            available=True,
            devices=("CPU", "GPU") if gpu else ("CPU",),
            runtime_version=f"llama-cpp-python {llama_cpp.__version__} "
            f"(cpu: {cpu or 'no SIMD'}; gpu offload: {'yes' if gpu else 'no'})",
        )

    # ------------------------------------------------------------------ lifecycle

    async def load(self, config: ModelConfig, artifact: Path, device: Device) -> None:
        options = parse_options(config)
        # Selection gives an NVIDIA GPU (NVML index) when one is usable, else the CPU.
        on_gpu = device.kind == "gpu:nvidia"
        main_gpu = device.index if on_gpu else 0
        settings = EngineSettings(
            model_name=self.context.model_name or config.name,
            model_path=artifact,
            n_ctx=options.n_ctx,
            n_parallel=options.n_parallel,
            n_batch=options.n_batch,
            n_threads=options.n_threads or self.context.threads,
            n_gpu_layers=options.n_gpu_layers if options.n_gpu_layers is not None else (-1 if on_gpu else 0),
            main_gpu=main_gpu,
            embedding=options.embedding,
            pooling=options.pooling,
            max_queue=options.max_queue,
            chat_template=options.chat_template,
            flash_attn=options.flash_attn,
            prefix_store_mib=(
                options.prefix_store_mib if options.prefix_store_mib is not None else default_prefix_store_mib()
            ),
            lora=parse_lora(config, options.lora, artifact.parent),
            context_shift=options.context_shift,
            cache_reuse=options.cache_reuse,
            cpus=self.context.cpus,
        )
        if options.slot_save_path:
            self._slot_dir = await asyncio.to_thread(self._slot_directory, config, options.slot_save_path)
        self._outbox = Outbox(asyncio.get_running_loop())
        engine = Engine(settings)
        # Set before waiting: if this load is cancelled, the daemon's unload() stops the
        # engine once its thread has finished loading (shield: the thread must not see its
        # `ready` future cancelled under it).
        self._engine = engine
        try:
            await asyncio.shield(asyncio.wrap_future(engine.ready))
        except EdgedError:
            self._engine = None  # the engine thread has freed what it loaded and exited
            raise

    def _slot_directory(self, config: ModelConfig, given: str) -> Path:
        path = Path(given)
        if not path.is_absolute():
            if ".." in path.parts:
                # A relative path is the version's own: it must not reach another's files.
                raise ConfigError(
                    f"model '{config.name}': parameters slot_save_path: {given!r} leaves the model version's "
                    "state directory ('..'); give a path under it or an absolute path"
                )
            if self.context.state_dir is None:
                raise ConfigError(
                    f"model '{config.name}': parameters slot_save_path: {given!r} is relative and this "
                    "instance has no state directory to put it under; give an absolute path"
                )
            path = self.context.state_dir / path
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ConfigError(f"model '{config.name}': parameters slot_save_path: cannot create {path}: {exc}") from None
        return path

    def unload_sync(self) -> None:
        engine, self._engine = self._engine, None
        if engine is not None:
            engine.stop()

    async def unload(self) -> None:
        await super().unload()
        # After the engine's thread has stopped (or was given up on: its later results are
        # dropped), on the loop's thread, which the outbox's reader belongs to.
        outbox, self._outbox = self._outbox, None
        if outbox is not None:
            outbox.close()

    def _emitter(self, deliver: Callable[[T], None]) -> Callable[[T], None]:
        """A callback the engine thread may call: runs `deliver` on the event loop's thread."""
        if self._outbox is None:
            raise Unavailable(f"model '{self.context.model_name}' is not loaded")
        return self._outbox.emitter(deliver)

    async def _job_result(self, submit: Callable[[Callable[[T | EdgedError], None]], EmbedJob | SlotJob]) -> T:
        """Submit an engine job (`submit(done)`) and await what its `done` callback gives, from
        the engine thread; a caller gone (cancelled) cancels the job."""
        future: asyncio.Future[T] = asyncio.get_running_loop().create_future()

        def settle(result: T | EdgedError) -> None:
            if future.done():
                return
            if isinstance(result, EdgedError):
                future.set_exception(result)
            else:
                future.set_result(result)

        job = submit(self._emitter(settle))
        try:
            return await future
        finally:
            job.cancel()

    def engine_stats(self) -> dict[str, int | float | str]:
        """Slots, queue, cache counters (Engine.stats) and the chat template used.

        Zeros when not loaded.
        """
        engine = self._engine
        if engine is None:
            return {"slots": 0, "busy": 0, "queued": 0, "tokens_generated": 0}
        stats: dict[str, int | float | str] = dict(engine.stats())
        stats["n_ctx_per_slot"] = engine.n_ctx_seq
        if engine.chat_template is not None:
            stats["chat_template"] = engine.chat_template.source
            stats["chat_template_tools"] = engine.chat_template.tool_syntax
            stats["chat_template_thinking"] = "".join(engine.chat_template.thinking)
        return stats

    def lora_adapters(self) -> list[LoraAdapter]:
        engine = self._engine
        return engine.lora_adapters() if engine is not None else []

    def set_lora_scales(self, scales: tuple[float, ...]) -> None:
        engine = self._engine
        if engine is None:
            raise Unavailable(f"model '{self.context.model_name}' is not loaded")
        engine.set_lora_scales(scales)

    def reranker(self) -> bool:
        engine = self._engine
        return engine is not None and engine.reranker

    def unpooled(self) -> bool:
        engine = self._engine
        return engine is not None and engine.unpooled

    async def props(self) -> GenerationProps:
        """The engine's slots and context, what its vocabulary and GGUF say (read on this
        instance's thread, beside the engine's). No media:
        this backend takes text only."""
        import llama_cpp

        engine = self._require_generating()
        # One hop to this instance's thread for both reads.
        (template, bos, eos, ftype), facts = await self.run_blocking(lambda: (engine.describe(), engine.model_facts()))
        return GenerationProps(
            n_ctx=engine.n_ctx_seq, total_slots=engine.settings.n_parallel, chat_template=template,
            bos_token=bos, eos_token=eos, ftype=ftype,
            build_info=f"llama-cpp-python {llama_cpp.__version__}", vocab_type=facts["vocab_type"],
            n_vocab=facts["n_vocab"], n_ctx_train=facts["n_ctx_train"], n_embd=facts["n_embd"],
            n_params=facts["n_params"], size=facts["size"],
        )

    def slots(self) -> list[SlotState]:
        return self._require_generating().slot_states()

    def control(self, control_id: str, action: str) -> str:
        return self._require_generating().control(control_id, action)

    async def slot_action(self, action: SlotAction, slot: int, filename: str = "") -> SlotFile:
        engine = self._require_generating()
        name = self.context.model_name
        count = engine.settings.n_parallel
        if not 0 <= slot < count:
            raise InvalidArgument(f"id_slot: model '{name}' has slots 0 to {count - 1}, got {slot}")
        path = None
        if action != "erase":
            if self._slot_dir is None:
                raise Unsupported(
                    f"model '{name}' does not save slots: set its parameters slot_save_path to a "
                    "directory (llama-server's --slot-save-path)"
                )
            # The route checks names as llama-server does; this keeps any caller in the directory.
            if filename in ("", ".", "..") or Path(filename).name != filename:
                raise InvalidArgument(f"filename: a file name without a directory, got {filename!r}")
            path = self._slot_dir / filename
        result: tuple[int, int, float] = await self._job_result(
            lambda done: engine.submit_slot_action(action, slot, path, done)
        )
        n_tokens, n_bytes, ms = result
        return SlotFile(n_tokens=n_tokens, n_bytes=n_bytes, ms=ms)

    def _require_generating(self) -> Engine:
        engine = self._require_engine()
        if engine.settings.embedding:
            raise InvalidArgument(f"model '{self.context.model_name}' is an embedding model; it has no generation slots")
        return engine

    def _require_engine(self) -> Engine:
        if self._engine is None:
            raise Unavailable(f"model '{self.context.model_name}' is not loaded")
        return self._engine

    # ------------------------------------------------------------------ generation

    def generate(self, prompt: str | list[int], params: GenerateParams) -> AsyncGenerator[GenerateChunk, None]:
        """Stream chunks; the last one has finish_reason and the usage counts.

        A full queue raises Unavailable here already; errors found by the engine (prompt too
        long: InvalidArgument) surface at the first `__anext__`, before any chunk. Closing the
        iterator (`aclose()`, or cancelling the task awaiting it) cancels the sequence.
        """
        engine = self._require_engine()
        engine.check_capacity()
        return self._stream(engine, prompt, params)

    async def _stream(
        self, engine: Engine, prompt: str | list[int], params: GenerateParams
    ) -> AsyncGenerator[GenerateChunk, None]:
        _check_params(params)
        slots = engine.settings.n_parallel
        if not -1 <= params.id_slot < slots:
            raise InvalidArgument(f"id_slot: model '{self.context.model_name}' has slots 0 to {slots - 1} (-1: any), got {params.id_slot}")
        if params.grammar or params.json_schema or params.tool_calls is not None:
            # Off the loop: a large schema takes the converter (pure Python) tenths of a second
            # and more, and the check reads megabytes of grammar.
            params = await asyncio.to_thread(_with_grammar, params)
        if params.answer_header:
            raise InvalidArgument("answer_header: only together with json_schema")
        if params.grammar and params.ignore_eos:
            # A complete grammar allows only end-of-generation tokens, which ignore_eos bans:
            # llama.cpp then samples a token the grammar rejects and aborts the process.
            raise InvalidArgument("ignore_eos cannot be used together with grammar, json_schema or tool_calls")
        if "infill" in params.samplers and (params.grammar or params.ignore_eos):
            # llama.cpp's infill sampler ends the output (EOT) when no token stands out, whatever
            # the biases and the grammar allow: a grammar would reject it and abort the process.
            raise InvalidArgument(
                "samplers: infill cannot be used together with grammar, json_schema, tool_calls or ignore_eos"
            )
        queue: asyncio.Queue[GenerateChunk | EdgedError] = asyncio.Queue()
        request = engine.submit(prompt, params, self._emitter(queue.put_nowait))
        first = True
        try:
            while True:
                item = await queue.get()
                if isinstance(item, EdgedError):
                    raise item
                yield item
                if first:
                    # Back for more: the consumer has sent the first chunk on, which the
                    # engine waits for before its next decode (Engine._hand_over_first_chunks).
                    request.took_first()
                    first = False
                if item.finish_reason is not None:
                    return
        finally:
            # No-op after the last chunk; otherwise the engine drops the sequence next step.
            request.cancel()

    def chat_prompt(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        template_kwargs: Mapping[str, Any] | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> str:
        """Messages rendered with the model's chat template (templates.py): role, content and
        name; with a Jinja template also OpenAI `tools`, assistant `tool_calls` and `tool`
        messages, as llama-server's `--jinja` renders them."""
        engine = self._require_engine()
        if engine.chat_template is None:  # an embedding model
            raise InvalidArgument(f"model '{self.context.model_name}' is an embedding model; it does not chat")
        return engine.chat_template.render(messages, template_kwargs or {}, tools=tools)

    async def tokenize(self, text: str, *, add_special: bool = False, parse_special: bool = True) -> list[int]:
        """On this instance's thread, beside the engine's (which keeps decoding meanwhile)."""
        engine = self._require_engine()
        return await self.run_blocking(engine.tokenize, text, add_special=add_special, parse_special=parse_special)

    async def token_pieces(self, tokens: Sequence[int]) -> list[bytes]:
        engine = self._require_engine()
        return await self.run_blocking(engine.token_pieces, list(tokens))

    async def infill_tokens(self, infill: InfillInput) -> list[int]:
        engine = self._require_engine()
        return await self.run_blocking(engine.infill_tokens, infill)

    def thinking_tags(self) -> tuple[str, str]:
        """The chat template's reasoning tags (templates.thinking_tags_of); none when not loaded."""
        engine = self._engine
        if engine is None or engine.chat_template is None:
            return ("", "")
        return engine.chat_template.thinking

    def tool_syntax(self) -> str:
        """The chat template's tool-call syntax (templates.tool_syntax_of); "" when not loaded."""
        engine = self._engine
        if engine is None or engine.chat_template is None:
            return ""
        return engine.chat_template.tool_syntax

    async def embed(
        self, texts: Sequence[str | list[int]], *, truncate: bool = False
    ) -> tuple[list[list[float]], int]:
        """L2-normalised pooled embeddings (what OpenAI and llama-server return) + token count.
        A text is tokenized with the model's special tokens; token ids are embedded as given."""
        engine = self._require_engine()
        if not engine.settings.embedding:
            # Asking a generation model for embeddings is the client's mistake: 400, not 501.
            raise InvalidArgument(
                f"model '{self.context.model_name}' is a text generation model; load it with "
                "parameters embedding=true to serve embeddings"
            )
        # Token lists copied: the engine thread reads them after this call returns.
        inputs = [text if isinstance(text, str) else list(text) for text in texts]
        return await self._job_result(lambda done: engine.submit_embed(inputs, done, truncate=truncate))

    async def rerank(self, query: str, documents: Sequence[str]) -> tuple[list[float], int]:
        """The first output of the classifier head for each query-document pair (llama-server's
        /rerank score, Qwen3's "yes" probability) + the prompt tokens of all pairs."""
        engine = self._require_engine()
        if not engine.settings.embedding:
            raise InvalidArgument(
                f"model '{self.context.model_name}' is a text generation model, not a reranker; a "
                "reranker is a GGUF whose pooling is rank, loaded with parameters embedding=true"
            )
        pairs = list(documents)
        return await self._job_result(lambda done: engine.submit_rerank(query, pairs, done))


# llama.cpp samples with 32-bit floats: a finite number beyond this would reach it as infinity.
_FLOAT32_MAX = 3.4028234663852886e38  # numpy.finfo(numpy.float32).max
_FLOAT_FIELDS = (
    "temperature", "top_p", "min_p", "typical_p", "repeat_penalty", "mirostat_tau", "mirostat_eta",
    "dynatemp_range", "dynatemp_exponent", "top_n_sigma", "xtc_probability", "xtc_threshold", "dry_multiplier",
    "dry_base",
)


def _with_grammar(params: GenerateParams) -> GenerateParams:
    """`params` with the grammar its json_schema or tool_calls make, checked (InvalidArgument
    naming where it came from). Blocks: call it off the loop."""
    source = "grammar"  # what the grammar comes from, for the error that names it
    if params.tool_calls is not None:
        source = "tools"
        if params.grammar:
            raise InvalidArgument("tool_calls cannot be used together with grammar")
        # The engine reads `tool_calls` on for a lazy frame's trigger. A `json_schema`
        # beside the frame is the answer the output may write instead of the calls.
        params = msgspec.structs.replace(
            params,
            grammar=tool_call_grammar(params.tool_calls, params.json_schema, params.answer_header),
            json_schema="", answer_header="",
        )
    elif params.json_schema:
        source = "json_schema"
        if params.grammar:
            raise InvalidArgument("json_schema and grammar cannot be used together")
        params = msgspec.structs.replace(
            params, grammar=schema_to_grammar(params.json_schema, "json_schema", params.answer_header),
            json_schema="", answer_header="",
        )
    if params.grammar:
        check_grammar(params.grammar, source)
    return params


def _check_params(params: GenerateParams) -> None:
    for name in _FLOAT_FIELDS:
        value = getattr(params, name)
        if math.isfinite(value) and abs(value) > _FLOAT32_MAX:
            raise InvalidArgument(f"{name} must be within llama.cpp's 32-bit floats (at most {_FLOAT32_MAX:.6g} "
                                  f"either way), got {value}")
    if params.max_tokens is not None and params.max_tokens < 0:
        raise InvalidArgument(f"max_tokens must be >= 0, got {params.max_tokens}")
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(params, name)
        if not -2.0 <= value <= 2.0:
            raise InvalidArgument(f"{name} must be in [-2, 2], got {value}")
    if params.logprobs is not None and not 0 <= params.logprobs <= 20:
        raise InvalidArgument(f"logprobs must be in [0, 20], got {params.logprobs}")
    if params.prompt_logprobs is not None and not 0 <= params.prompt_logprobs <= 20:
        raise InvalidArgument(f"prompt_logprobs must be in [0, 20], got {params.prompt_logprobs}")
    # -inf: a ban (llama-server's `false`), which llama.cpp's logit-bias sampler applies as is.
    bad = next((b for b in params.logit_bias.values() if not -100.0 <= b <= 100.0 and b != -math.inf), None)
    if bad is not None:
        raise InvalidArgument(f"logit_bias values must be in [-100, 100] (or -inf: banned), got {bad}")
    if params.repeat_penalty <= 0:
        raise InvalidArgument(f"repeat_penalty must be > 0, got {params.repeat_penalty}")
    # llama.cpp takes these as 32-bit integers: a larger one would reach it as another number.
    for name, low in (("penalty_last_n", -1), ("dry_penalty_last_n", -1), ("top_k", -(2**31)),
                      ("dry_allowed_length", 0), ("min_keep", 0)):
        value = getattr(params, name)
        if value is not None and not low <= value < 2**31:
            raise InvalidArgument(f"{name} must be between {low} and {2**31 - 1}, got {value}")
    if not 0.0 <= params.top_p <= 1.0:
        raise InvalidArgument(f"top_p must be in [0, 1], got {params.top_p}")
    if not 0.0 <= params.min_p <= 1.0:
        raise InvalidArgument(f"min_p must be in [0, 1], got {params.min_p}")
    if params.n_indent < 0:
        raise InvalidArgument(f"n_indent must be >= 0, got {params.n_indent}")
    unknown = next((name for name in params.samplers if name not in SAMPLERS), None)
    if unknown is not None:
        raise InvalidArgument(f"samplers: unknown sampler {unknown!r}")


