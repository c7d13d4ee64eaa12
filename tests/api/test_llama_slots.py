"""llama-server's POST /slots/{id}?action=save|restore|erase (daemon/api/llama_native.py,
backends/llamacpp/engine.py) against the daemon serving tiny GGUFs on llama.cpp, over its real
socket: what a saved file restores is the slot's cache (the next completion decodes only
what follows it, with the same greedy text), and erase drops it.
tests/fixtures/oracle/llama_slots.py restores llama-server's files here and ours there."""

from __future__ import annotations

import json
import os
import struct
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("llama_cpp")


from support import llamacpp_models, start_daemon_process, wait_until

PROMPT = "The quick brown fox jumps over the lazy dog and runs"


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    repo = tmp_path_factory.mktemp("slots-repo")
    models: dict[str, tuple[dict[str, Any], dict[str, str]]] = {
        # No prefix store: what a slot holds comes from its own requests and files only.
        "tiny": ({"seed": 1}, {"n_parallel": "2", "slot_save_path": "slots", "prefix_store_mib": "0"}),
        # Another shape: its cells do not fit a file of tiny's.
        "wide": ({"seed": 2, "n_embd": 128}, {"n_parallel": "2", "slot_save_path": "slots"}),
        "one": ({"seed": 1, "n_ctx": 4096}, {"n_parallel": "1", "slot_save_path": "slots"}),
        "pair": ({"seed": 1, "n_ctx": 4096}, {"n_parallel": "2", "prefix_store_mib": "0"}),
        "plain": ({"seed": 1}, {"n_parallel": "1"}),
        "embed": ({"seed": 1, "pooling": 1}, {"embedding": "true"}),
    }
    llamacpp_models(repo, models)
    # Explicit control, all loaded at start: a test loads a model with another config.
    process = start_daemon_process(tmp_path_factory.mktemp("edged"), "--model-repository", str(repo),
                                   "--model-control-mode", "explicit", "--load-model", "*")
    yield process
    process.stop()


def complete(daemon: Any, model: str = "tiny", n_predict: int = 8) -> Any:
    return daemon.post_ok("/completion", {"model": model, "prompt": PROMPT, "n_predict": n_predict, "temperature": 0})


def slot_dir(daemon: Any, model: str) -> Path:
    return daemon.state_dir / "models" / model / "1" / "slots"


def test_save_erase_restore(daemon: Any) -> None:
    for slot in (0, 1):
        daemon.post_ok(f"/slots/{slot}?action=erase", {"model": "tiny"})
    cold = complete(daemon)
    prompt_tokens, predicted = cold["tokens_evaluated"], cold["tokens_predicted"]
    assert cold["timings"]["cache_n"] == 0 and predicted == 8
    # Two empty slots: the first one served it (least recently used, lowest index first).
    saved = daemon.post_ok("/slots/0?action=save", {"model": "tiny", "filename": "fox.bin"})
    # The prompt and the generated tokens but the last, whose cells were never computed.
    assert saved["n_saved"] == prompt_tokens + predicted - 1
    assert saved["id_slot"] == 0 and saved["filename"] == "fox.bin"
    assert saved["n_written"] == (slot_dir(daemon, "tiny") / "fox.bin").stat().st_size > 12
    assert set(saved["timings"]) == {"save_ms"}
    assert daemon.post_ok("/slots/0?action=erase", {"model": "tiny"}) == {"id_slot": 0, "n_erased": saved["n_saved"]}
    # Nothing cached anywhere now: the prompt is decoded again, into slot 1.
    again = complete(daemon)
    assert again["timings"]["cache_n"] == 0 and again["content"] == cold["content"]
    daemon.post_ok("/slots/1?action=erase", {"model": "tiny"})
    restored = daemon.post_ok("/slots/0?action=restore", {"model": "tiny", "filename": "fox.bin"})
    assert restored["n_restored"] == saved["n_saved"] and restored["n_read"] == saved["n_written"]
    assert restored["id_slot"] == 0 and set(restored["timings"]) == {"restore_ms"}
    warm = complete(daemon)
    # All but the prompt's last token came from the file (its logits give the first token).
    assert warm["timings"]["cache_n"] == prompt_tokens - 1
    assert warm["content"] == cold["content"]


def test_a_save_replaces_the_file_whole(daemon: Any) -> None:
    """A save writes beside the file and renames over it: a reader of the old file (another
    engine of the model during a reload, restoring it) keeps reading all of the old one, where
    llama.cpp's in-place rewrite cut it short under the reader. Nothing else stays behind."""
    complete(daemon)
    daemon.post_ok("/slots/0?action=save", {"model": "tiny", "filename": "twice.bin"})
    path = slot_dir(daemon, "tiny") / "twice.bin"
    with path.open("rb") as old:
        before = path.read_bytes()
        daemon.post_ok("/slots/0?action=erase", {"model": "tiny"})
        complete(daemon, n_predict=2)
        again = daemon.post_ok("/slots/0?action=save", {"model": "tiny", "filename": "twice.bin"})
        assert os.fstat(old.fileno()).st_ino != path.stat().st_ino
        assert old.read() == before and path.stat().st_size == again["n_written"] != len(before)
    assert not [p.name for p in slot_dir(daemon, "tiny").iterdir() if p.name.startswith(".")]


def save_served(daemon: Any, n_predict: int = 8) -> tuple[Any, Any]:
    """A cold completion on an emptied tiny, and the save of the slot that served it."""
    for slot in (0, 1):
        daemon.post_ok(f"/slots/{slot}?action=erase", {"model": "tiny"})
    cold = complete(daemon, n_predict=n_predict)
    saved = [daemon.post_ok(f"/slots/{slot}?action=save", {"model": "tiny", "filename": f"s{slot}.bin"}) for slot in (0, 1)]
    # One slot served it; the other saved an empty cache.
    used = next(s for s in saved if s["n_saved"])
    assert sorted(s["n_saved"] for s in saved) == [0, used["n_saved"]]
    for slot in (0, 1):
        daemon.post_ok(f"/slots/{slot}?action=erase", {"model": "tiny"})
    return cold, used


def test_restore_into_another_slot(daemon: Any) -> None:
    cold, used = save_served(daemon, n_predict=12)
    other = 1 - used["id_slot"]
    daemon.post_ok(f"/slots/{other}?action=restore", {"model": "tiny", "filename": used["filename"]})
    warm = complete(daemon, n_predict=12)
    assert warm["content"] == cold["content"] and warm["timings"]["cache_n"] == cold["tokens_evaluated"] - 1


def test_save_waits_for_the_slot_to_finish(daemon: Any) -> None:
    daemon.post_ok("/slots/0?action=erase", {"model": "one"})
    result: dict[str, Any] = {}

    def generate() -> None:
        result["completion"] = complete(daemon, "one", n_predict=1500)

    worker = threading.Thread(target=generate)
    worker.start()
    wait_until(lambda: daemon.get_json("/slots?model=one")[0]["is_processing"])
    saved = daemon.post_ok("/slots/0?action=save", {"model": "one", "filename": "long.bin"})
    worker.join(60)
    completion = result["completion"]
    # Saved after the generation ended: every token it computed is in the file.
    assert saved["n_saved"] == completion["tokens_evaluated"] + completion["tokens_predicted"] - 1


def test_a_file_of_another_model_does_not_restore(daemon: Any) -> None:
    daemon.post_ok("/slots/0?action=erase", {"model": "tiny"})
    daemon.post_ok("/completion", {"model": "tiny", "prompt": PROMPT, "n_predict": 8, "id_slot": 0})
    assert daemon.post_ok("/slots/0?action=save", {"model": "tiny", "filename": "tiny.bin"})["n_saved"] > 0
    target = slot_dir(daemon, "wide")
    (target / "tiny.bin").write_bytes((slot_dir(daemon, "tiny") / "tiny.bin").read_bytes())
    # Warm wide's slot 0 first: a failed restore leaves it empty, not as it was nor half read.
    daemon.post_ok("/completion", {"model": "wide", "prompt": PROMPT, "n_predict": 2, "id_slot": 0})
    body = daemon.post_ok("/slots/0?action=restore", {"model": "wide", "filename": "tiny.bin"}, 400)
    # Same slot count, other shape: llama.cpp's own reason, not the layout's.
    assert body["error"]["message"].startswith("Unable to restore slot 0: "), body
    assert "mismatched" in body["error"]["message"] and "n_parallel" not in body["error"]["message"], body
    # The reason names the file as the client did, not where the daemon keeps it.
    assert str(daemon.state_dir) not in body["error"]["message"]
    # The slot is empty (an erase finds nothing) and the model still serves.
    assert daemon.post_ok("/slots/0?action=erase", {"model": "wide"})["n_erased"] == 0
    assert complete(daemon, "wide")["content"]
    # The same weights loaded with one slot, not two: llama.cpp's layout differs.
    (slot_dir(daemon, "one") / "tiny.bin").write_bytes((slot_dir(daemon, "tiny") / "tiny.bin").read_bytes())
    body = daemon.post_ok("/slots/0?action=restore", {"model": "one", "filename": "tiny.bin"}, 400)
    assert "another n_parallel" in body["error"]["message"], body
    (target / "junk.bin").write_bytes(b"not a slot file at all")
    body = daemon.post_ok("/slots/0?action=restore", {"model": "wide", "filename": "junk.bin"}, 400)
    assert body["error"]["message"].startswith("Unable to restore slot 0: ")
    body = daemon.post_ok("/slots/0?action=restore", {"model": "wide", "filename": "missing.bin"}, 400)
    assert body["error"]["message"] == "Unable to restore slot 0: no file 'missing.bin' in the model's slot_save_path"


def test_a_file_cut_short_is_a_400_not_an_abort(daemon: Any) -> None:
    """llama.cpp's own file reader (llama_state_seq_load_file) read past the end of a file cut
    short and failed GGML_ASSERT(nread <= state_size), which aborts the process: with one slot,
    at any cut in the state. The engine reads the file and hands llama.cpp a buffer."""
    daemon.post_ok("/slots/0?action=erase", {"model": "one"})
    complete(daemon, "one")
    saved = daemon.post_ok("/slots/0?action=save", {"model": "one", "filename": "whole.bin"})
    data = (slot_dir(daemon, "one") / "whole.bin").read_bytes()
    assert saved["n_written"] == len(data)
    for cut in (4, len(data) // 3):
        (slot_dir(daemon, "one") / "cut.bin").write_bytes(data[:-cut])
        body = daemon.post_ok("/slots/0?action=restore", {"model": "one", "filename": "cut.bin"}, 400)
        assert body["error"]["message"].startswith("Unable to restore slot 0: "), body
        assert "failed to restore" in body["error"]["message"], body
    # Still serving, and the whole file restores all it holds, counted as llama-server counts.
    restored = daemon.post_ok("/slots/0?action=restore", {"model": "one", "filename": "whole.bin"})
    assert (restored["n_restored"], restored["n_read"]) == (saved["n_saved"], len(data)), restored
    assert complete(daemon, "one")["timings"]["cache_n"] > 0


def test_a_file_with_tokens_this_model_cannot_take(daemon: Any) -> None:
    _, saved = save_served(daemon)
    data = bytearray((slot_dir(daemon, "tiny") / saved["filename"]).read_bytes())
    # llama.cpp's header (magic, version, count), then llama-server's packing: a null token,
    # its version, the token count, the tokens, the count of media chunks.
    header = struct.unpack_from("<3I3i", data)
    assert header[2:] == (saved["n_saved"] + 4, -1, 1, saved["n_saved"])
    cases = {
        "vocab.bin": (24, 10_000, "outside this model's vocabulary"),
        "media.bin": (24 + 4 * saved["n_saved"], 1, "media"),
        "version.bin": (16, 7, "unknown version"),
    }
    # One token fewer in both counts than the file has KV cells (a file that reads whole).
    n = saved["n_saved"]
    short = bytearray(data[: 24 + 4 * (n - 1)]) + data[24 + 4 * n:]
    struct.pack_into("<I", short, 8, n + 3)
    struct.pack_into("<i", short, 20, n - 1)
    (slot_dir(daemon, "tiny") / "short.bin").write_bytes(bytes(short))
    cases["short.bin"] = (0, 0, f"it holds {n - 1} tokens for {n} KV cells")
    # Cut short: in the state, in the token list, in the header.
    (slot_dir(daemon, "tiny") / "cut.bin").write_bytes(bytes(data[:-4]))
    cases["cut.bin"] = (0, 0, "failed to restore")
    (slot_dir(daemon, "tiny") / "cut-tokens.bin").write_bytes(bytes(data[:30]))
    cases["cut-tokens.bin"] = (0, 0, "the file is cut short in its token list")
    (slot_dir(daemon, "tiny") / "cut-header.bin").write_bytes(bytes(data[:10]))
    cases["cut-header.bin"] = (0, 0, "not a slot file (it has 10 bytes)")
    for name, (offset, value, reason) in cases.items():
        if offset:
            changed = bytearray(data)
            struct.pack_into("<i", changed, offset, value)
            (slot_dir(daemon, "tiny") / name).write_bytes(bytes(changed))
        message = daemon.post_ok("/slots/0?action=restore", {"model": "tiny", "filename": name}, 400)["error"]["message"]
        assert message.startswith("Unable to restore slot 0: ") and reason in message, message
        # Nothing of the file stays in the slot.
        assert daemon.post_ok("/slots/0?action=erase", {"model": "tiny"})["n_erased"] == 0
        for slot in (0, 1):
            daemon.post_ok(f"/slots/{slot}?action=erase", {"model": "tiny"})


def test_id_slot_picks_the_slot(daemon: Any) -> None:
    for slot in (0, 1):
        daemon.post_ok(f"/slots/{slot}?action=erase", {"model": "tiny"})
    answer = daemon.post_ok("/completion", {"model": "tiny", "prompt": PROMPT, "n_predict": 4, "temperature": 0, "id_slot": 1})
    assert answer["id_slot"] == 1
    assert daemon.post_ok("/slots/0?action=erase", {"model": "tiny"})["n_erased"] == 0
    # Its cache is slot 1's: the same prompt sent to slot 0 decodes it all again.
    again = daemon.post_ok("/completion", {"model": "tiny", "prompt": PROMPT, "n_predict": 4, "temperature": 0, "id_slot": 0})
    assert again["id_slot"] == 0 and again["timings"]["cache_n"] == 0 and again["content"] == answer["content"]
    # Streamed, every event names the slot.
    reply = daemon.post_json("/completion", {"model": "tiny", "prompt": PROMPT, "n_predict": 4, "temperature": 0, "id_slot": 1, "stream": True})
    events = [json.loads(line[6:]) for line in reply.body.decode().split("\n") if line.startswith("data: ")]
    assert len(events) > 1 and {event["id_slot"] for event in events} == {1}
    assert events[-1]["timings"]["cache_n"] > 0
    # Without it, the slot that holds the prompt: reported, not chosen by the client.
    assert daemon.post_ok("/completion", {"model": "tiny", "prompt": PROMPT, "n_predict": 4, "temperature": 0})["id_slot"] in (0, 1)
    # The OpenAI routes take it too, as llama-server's do.
    daemon.post_ok("/slots/0?action=erase", {"model": "tiny"})
    daemon.post_ok("/v1/completions", {"model": "tiny", "prompt": "Other words", "max_tokens": 4, "id_slot": 0})
    assert daemon.post_ok("/slots/0?action=erase", {"model": "tiny"})["n_erased"] > 0


def test_id_slot_waits_for_its_slot(daemon: Any) -> None:

    done: list[str] = []

    def run(name: str, body: dict[str, Any]) -> None:
        answer = daemon.post_ok("/completion", {"model": "pair", "temperature": 0, **body})
        assert answer["id_slot"] == 0 or name == "any"
        done.append(name)  # list.append is atomic: the order the answers came in

    long = threading.Thread(target=run, args=("long", {"prompt": PROMPT, "n_predict": 2000, "id_slot": 0}))
    long.start()
    wait_until(lambda: daemon.get_json("/slots?model=pair")[0]["is_processing"])
    # Slot 1 is idle, but this request asked for slot 0: it waits for the long one.
    answers: dict[str, Any] = {}
    short = threading.Thread(target=lambda: answers.update(short=daemon.post_ok("/completion", {
        "model": "pair", "temperature": 0, "prompt": PROMPT, "n_predict": 2, "id_slot": 0})))
    short.start()
    # One that can use any slot does not wait behind it.
    run("any", {"prompt": "Hi", "n_predict": 2})
    assert done == ["any"] and "short" not in answers
    long.join(60)
    short.join(60)
    # It ran in slot 0 after the long one: it found the long one's prompt cached there (the
    # model has no prefix store; nothing else ever ran in slot 0).
    assert answers["short"]["id_slot"] == 0 and answers["short"]["timings"]["cache_n"] > 0


@pytest.mark.parametrize(
    ("path", "body", "named"),
    [
        ("/slots/0?action=save", {"model": "tiny", "filename": "../x.bin"}, "filename"),
        ("/slots/0?action=save", {"model": "tiny", "filename": "a/b.bin"}, "filename"),
        ("/slots/0?action=save", {"model": "tiny", "filename": "x."}, "filename"),
        ("/slots/0?action=save", {"model": "tiny", "filename": ""}, "filename"),
        ("/slots/0?action=save", {"model": "tiny"}, "filename"),
        ("/slots/0?action=restore", {"model": "tiny"}, "filename"),
        ("/slots/0?action=erase", {"model": "tiny", "filename": "x.bin"}, "filename"),
        ("/slots/0?action=load", {"model": "tiny", "filename": "x.bin"}, "action"),
        ("/slots/0", {"model": "tiny"}, "action"),
        ("/slots/0?action=erase&model=tiny", {"model": "tiny"}, "model: not a query field"),
        ("/slots/2?action=erase", {"model": "tiny"}, "id_slot"),
        ("/slots/-1?action=erase", {"model": "tiny"}, "id_slot"),
        ("/slots/x?action=erase", {"model": "tiny"}, "id_slot"),
        ("/slots/0?action=erase", {}, "model"),
        ("/slots/0?action=erase", {"model": "tiny", "n_keep": 1}, "n_keep"),
        ("/slots/0?action=erase", {"model": "embed"}, "embedding model"),
    ],
)
def test_bad_requests_name_the_field(daemon: Any, path: str, body: dict[str, Any], named: str) -> None:
    message = daemon.post_ok(path, body, 400)["error"]["message"]
    assert named in message, message


def test_save_and_restore_need_a_slot_directory(daemon: Any) -> None:
    for action in ("save", "restore"):
        body = daemon.post_ok(f"/slots/0?action={action}", {"model": "plain", "filename": "x.bin"}, 501)
        assert "slot_save_path" in body["error"]["message"]
    # Erase writes no file: it needs none.
    complete(daemon, "plain")
    erased = daemon.post_ok("/slots/0?action=erase", {"model": "plain"})
    assert erased["n_erased"] > 0
    assert complete(daemon, "plain")["timings"]["cache_n"] == 0


def test_unknown_model_is_404(daemon: Any) -> None:
    reply = daemon.post_json("/slots/0?action=erase", {"model": "nope"})
    assert reply.status == 404 and "nope" in json.loads(reply.body)["error"]["message"]


def test_a_relative_slot_directory_stays_under_the_state_directory(daemon: Any) -> None:
    config = {"backend": "llamacpp", "parameters": {"n_parallel": {"string_value": "1"},
                                                    "slot_save_path": {"string_value": "../../escape"}}}
    reply = daemon.post_json("/v2/repository/models/plain/load", {"parameters": {"config": json.dumps(config)}})
    assert reply.status == 400, reply.body
    assert "slot_save_path: '../../escape' leaves the model version's state directory" in reply.json()["error"]
    assert not (daemon.state_dir / "models" / "escape").exists()
    # The version that served before still does.
    assert complete(daemon, "plain")["content"]
