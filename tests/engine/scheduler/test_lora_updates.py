"""The scheduler's bookkeeping of run-time adapter loads and unloads (engine/scheduler/
lora_updates.py): what reaches the workers, what is answered at once, when an unload is due."""

from __future__ import annotations

from deepinfer.engine.protocol import LoRAUpdate, LoRAUpdated
from deepinfer.engine.scheduler.lora_updates import RuntimeAdapters


def test_a_load_reaches_the_workers_and_salts_the_adapter_once_they_answer(tmp_path):
    salts = {"a": 1}
    adapters = RuntimeAdapters(salts)
    load = LoRAUpdate("r1", "c", str(tmp_path))
    assert adapters.update(load) == (load, None)
    again = adapters.update(LoRAUpdate("r2", "c", str(tmp_path)))
    assert again[0] is None and "being loaded" in again[1].error
    assert "c" not in salts  # not servable before the workers attached it
    answer = LoRAUpdated("r1", seconds=0.1, salt=77)
    assert adapters.loaded(answer) == answer and salts["c"] == 77
    assert adapters.loaded(LoRAUpdated("r1")) is None  # answered once


def test_a_refused_load_leaves_nothing_behind(tmp_path):
    salts: dict[str, int] = {}
    adapters = RuntimeAdapters(salts)
    adapters.update(LoRAUpdate("r1", "c", str(tmp_path)))
    assert adapters.loaded(LoRAUpdated("r1", "bad rank")).error == "bad rank"
    assert salts == {} and adapters.update(LoRAUpdate("r2", "c", "/x"))[0] is not None


def test_an_unload_waits_until_no_request_uses_the_adapter():
    salts = {"a": 1, "b": 2}
    adapters = RuntimeAdapters(salts)
    unload = LoRAUpdate("r1", "a", unload=True)
    assert adapters.update(unload) == (None, None)
    assert "a" not in salts  # new requests naming it are refused from now on
    assert adapters.unloads_due(["a", None, "b"]) == []
    assert adapters.unloads_due([None, "b"]) == [unload]
    assert adapters.unloads_due([]) == []  # sent once
    for name, why in (("a", "no LoRA adapter 'a'"), ("zzz", "no LoRA adapter 'zzz'")):
        assert why in adapters.update(LoRAUpdate("r2", name, unload=True))[1].error
    assert "already loaded" in adapters.update(LoRAUpdate("r3", "b", "/x"))[1].error


def test_the_kv_events_name_every_adapter_ever_served():
    """BlockStored carries lora_name: the names of adapters at start and loaded later (kept
    after an unload: their blocks may still be evicted or moved to a tier)."""
    from deepinfer.engine.scheduler.scheduler import Scheduler, SchedulerConfig

    s = Scheduler(SchedulerConfig(num_blocks=8, block_size=4, max_num_seqs=2,
                                  max_num_batched_tokens=16, context_len=32,
                                  kv_events_identity=b"k" * 32, lora_salts={"sql": 77}))
    assert s.kv_events.adapters == {77: "sql"}
    adapters = RuntimeAdapters(s.config.lora_salts, s.kv_events.adapters)
    adapters.update(LoRAUpdate("r1", "chat", "/x"))
    adapters.loaded(LoRAUpdated("r1", salt=91))
    adapters.update(LoRAUpdate("r2", "sql", unload=True))
    assert adapters.unloads_due([])
    assert s.kv_events.adapters == {77: "sql", 91: "chat"} and s.config.lora_salts == {"chat": 91}
