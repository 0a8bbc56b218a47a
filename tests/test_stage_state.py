"""Stage state snapshots and checkpoints: pure, no event loop, no network.

Round trips must be exact (the next optimizer step after a restore equals the one the original
would have taken); hostile bytes must raise BadStageState and nothing else; checkpoints must
survive a crash mid-write and report corruption with a message saying what to do."""

from __future__ import annotations

import os
import struct
from pathlib import Path
from typing import Any

import msgpack
import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from swarmd.state import checkpoint as ckpt
from swarmd.state import encoding as ss
from swarmd.state.checkpoint import CorruptCheckpoint, load_checkpoint, quarantine, save_checkpoint
from swarmd.state.encoding import BadStageState, StageState, StateMismatch

HASH = "model-abc"


def make_module(width: int = 8, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(width, 16), torch.nn.LayerNorm(16),
                               torch.nn.Linear(16, 4))


def trained(steps: int = 2, width: int = 8) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    module = make_module(width)
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-2, betas=(0.8, 0.99))
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        module(torch.randn(5, width, generator=gen)).pow(2).sum().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return module, optimizer


def one_step(module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    x = torch.arange(40, dtype=torch.float32).reshape(5, 8) / 40
    module(x).pow(2).sum().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def sample_state(stage: int = 1, step: int = 2) -> StageState:
    module, optimizer = trained(step)
    return ss.capture(module, optimizer, stage=stage, step=step, model_hash=HASH,
                      meta={"samples": 640, "note": ("a", 1)})


def same_tensors(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(
            same_tensors(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(
            same_tensors(x, y) for x, y in zip(a, b))
    return a == b


def forge(header: Any, data: bytes = b"", *, magic: bytes = ss.MAGIC,
          version: int = ss.VERSION) -> bytes:
    body = msgpack.packb(header, use_bin_type=True)
    return ss.PREFIX.pack(magic, version, len(body)) + body + data


def ref(i: int) -> msgpack.ExtType:
    return msgpack.ExtType(1, struct.pack("<I", i))


def valid_header(**over: Any) -> dict[str, Any]:
    header = {"stage": 0, "step": 1, "model_hash": HASH, "meta": {},
              "params": [["w", ref(0)]], "optimizer": {"state": {}, "param_groups": []},
              "tensors": [["float32", [2]]]}
    header.update(over)
    return header


# ---- round trips ------------------------------------------------------------------------

def test_round_trip_restores_exactly_and_the_next_step_matches() -> None:
    module, optimizer = trained(steps=3)
    state = ss.capture(module, optimizer, stage=2, step=3, model_hash=HASH, meta={"samples": 9})
    data = ss.encode(state)
    assert ss.encode(state) == data, "encoding must be deterministic"
    back = ss.decode(data)
    assert (back.stage, back.step, back.model_hash, back.meta) == (2, 3, HASH, {"samples": 9})
    assert same_tensors(dict(state.params), dict(back.params))
    assert same_tensors(dict(state.optimizer), dict(back.optimizer))
    assert back.optimizer["param_groups"][0]["betas"] == (0.8, 0.99)

    fresh = make_module(seed=42)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=0.5)
    ss.restore(back, fresh, fresh_opt, stage=2, model_hash=HASH)
    assert fresh_opt.param_groups[0]["lr"] == 1e-2
    one_step(module, optimizer)
    one_step(fresh, fresh_opt)
    assert same_tensors(dict(module.state_dict()), dict(fresh.state_dict()))
    assert same_tensors(optimizer.state_dict(), fresh_opt.state_dict())


def test_capture_and_restore_copy_so_training_does_not_change_the_snapshot() -> None:
    module, optimizer = trained()
    state = ss.capture(module, optimizer, stage=0, step=2, model_hash=HASH)
    frozen = ss.encode(state)
    one_step(module, optimizer)
    fresh = make_module(seed=3)
    fresh_opt = torch.optim.AdamW(fresh.parameters())
    ss.restore(state, fresh, fresh_opt, stage=0, model_hash=HASH)
    one_step(fresh, fresh_opt)
    assert ss.encode(state) == frozen


def test_every_dtype_empty_and_scalar_tensors_round_trip() -> None:
    params = {name: t for name, t in {
        "f32": torch.randn(3, 2), "f16": torch.randn(4).half(), "bf16": torch.randn(5).bfloat16(),
        "f64": torch.randn(2, dtype=torch.float64), "i8": torch.tensor([-3, 4], dtype=torch.int8),
        "u8": torch.tensor([255, 0], dtype=torch.uint8),
        "i16": torch.tensor([7], dtype=torch.int16),
        "i32": torch.tensor([[1, 2]], dtype=torch.int32), "i64": torch.tensor([2 ** 40]),
        "bool": torch.tensor([True, False, True]), "empty": torch.zeros(0, 3),
        "scalar": torch.tensor(2.5), "nan": torch.tensor([float("nan"), float("-inf")]),
        "strided": torch.arange(12.0).reshape(3, 4).t(),
    }.items()}
    state = StageState(stage=0, step=0, model_hash=HASH, params=params,
                       optimizer={"state": {0: {"step": torch.tensor(3.0)}}, "param_groups": [
                           {"lr": 0.1, "params": [0], "names": ["x"], "flag": None}]})
    back = ss.decode(ss.encode(state))
    for name, t in params.items():
        got = back.params[name]
        assert got.dtype == t.dtype and got.shape == t.shape, name
        assert torch.equal(got, t) or name == "nan", name
    assert torch.equal(back.params["nan"].isnan(), params["nan"].isnan())
    assert same_tensors(dict(state.optimizer), dict(back.optimizer))


def test_restore_refuses_what_does_not_fit_and_changes_nothing() -> None:
    state = sample_state(stage=1)
    module = make_module(seed=5)
    optimizer = torch.optim.AdamW(module.parameters())
    before = {k: v.clone() for k, v in module.state_dict().items()}
    with pytest.raises(StateMismatch, match="this peer trains other"):
        ss.restore(state, module, optimizer, stage=1, model_hash="other")
    with pytest.raises(StateMismatch, match="stage 1, this peer serves stage 2"):
        ss.restore(state, module, optimizer, stage=2, model_hash=HASH)
    wide = make_module(width=12)
    with pytest.raises(StateMismatch, match=r"'0.weight'.*\(16, 8\).*\(16, 12\)"):
        ss.restore(state, wide, torch.optim.AdamW(wide.parameters()), stage=1, model_hash=HASH)
    other = torch.nn.Sequential(torch.nn.Linear(8, 16))
    with pytest.raises(StateMismatch, match="unexpected"):
        ss.restore(state, other, torch.optim.AdamW(other.parameters()), stage=1, model_hash=HASH)
    split = torch.optim.AdamW([{"params": list(module.parameters())[:2]},
                               {"params": list(module.parameters())[2:]}])
    with pytest.raises(StateMismatch, match="parameter groups, this optimizer 2"):
        ss.restore(state, module, split, stage=1, model_hash=HASH)
    assert same_tensors(before, dict(module.state_dict()))
    assert StateMismatch.code == "state_mismatch" and BadStageState.code == "bad_stage_state"


# ---- hostile input ----------------------------------------------------------------------

HOSTILE = {
    "empty": b"",
    "short": b"SWST",
    "bad magic": forge(valid_header(), b"\0" * 8, magic=b"XXXX"),
    "bad version": forge(valid_header(), b"\0" * 8, version=9),
    "header len beyond data": ss.PREFIX.pack(ss.MAGIC, ss.VERSION, 1000) + b"\x80",
    "header len huge": ss.PREFIX.pack(ss.MAGIC, ss.VERSION, 2 ** 63) + b"\x80" * 64,
    "not msgpack": ss.PREFIX.pack(ss.MAGIC, ss.VERSION, 3) + b"\xc1\xc1\xc1",
    "trailing msgpack": ss.PREFIX.pack(ss.MAGIC, ss.VERSION, 2) + b"\x80\x80",
    "header not a map": forge([1, 2, 3]),
    "missing data": forge(valid_header(), b"\0" * 7),
    "extra data": forge(valid_header(), b"\0" * 9),
    "unknown dtype": forge(valid_header(tensors=[["complex64", [1]]]), b"\0" * 8),
    "dtype not a string": forge(valid_header(tensors=[[7, [2]]]), b"\0" * 8),
    "huge shape": forge(valid_header(tensors=[["float32", [2 ** 40, 2 ** 40]]]), b"\0" * 8),
    "negative dim": forge(valid_header(tensors=[["float32", [-2]]]), b"\0" * 8),
    "bool dim": forge(valid_header(tensors=[["float32", [True, 2]]]), b"\0" * 8),
    "too many dims": forge(valid_header(tensors=[["uint8", [1] * 9]]), b"\0"),
    "shape not a list": forge(valid_header(tensors=[["float32", 2]]), b"\0" * 8),
    "table not a list": forge(valid_header(tensors={"a": 1}), b"\0" * 8),
    "ref out of range": forge(valid_header(params=[["w", ref(5)]]), b"\0" * 8),
    "ref reused": forge(valid_header(params=[["w", ref(0)], ["v", ref(0)]]), b"\0" * 8),
    "ref short": forge(valid_header(params=[["w", msgpack.ExtType(1, b"\0")]]), b"\0" * 8),
    "unreferenced tensor": forge(valid_header(tensors=[["float32", [2]], ["uint8", [0]]]),
                                 b"\0" * 8),
    "duplicate name": forge(valid_header(params=[["w", ref(0)], ["w", ref(1)]],
                                         tensors=[["float32", [1]], ["float32", [1]]]),
                            b"\0" * 8),
    "param not a pair": forge(valid_header(params=[["w"]]), b"\0" * 8),
    "tensor in meta": forge(valid_header(meta={"x": ref(0)}, params=[]), b"\0" * 8),
    "unknown ext": forge(valid_header(optimizer={"x": msgpack.ExtType(9, b"")}), b"\0" * 8),
    "float map key": forge(valid_header(optimizer={1.5: 1}), b"\0" * 8),
    "bool tensor byte 2": forge(valid_header(tensors=[["bool", [2]]]), b"\x01\x02"),
    "negative step": forge(valid_header(step=-1), b"\0" * 8),
    "bool stage": forge(valid_header(stage=True), b"\0" * 8),
    "empty model hash": forge(valid_header(model_hash=""), b"\0" * 8),
    "optimizer not a map": forge(valid_header(optimizer=[1]), b"\0" * 8),
}


def nested_tuples(depth: int) -> Any:
    inner: Any = msgpack.packb([1])
    for _ in range(depth):
        inner = msgpack.packb([msgpack.ExtType(2, inner)])
    return msgpack.ExtType(2, inner)


HOSTILE["deep tuples"] = forge(valid_header(optimizer={"x": nested_tuples(200)}), b"\0" * 8)
_deep = b"\x91" * 5000 + b"\x01"
HOSTILE["deep lists"] = (ss.PREFIX.pack(ss.MAGIC, ss.VERSION, len(_deep)) + _deep)
_deepish: Any = 1
for _ in range(ss.MAX_DEPTH + 2):
    _deepish = [_deepish]
HOSTILE["deepish lists"] = forge(valid_header(optimizer={"x": _deepish}), b"\0" * 8)


def test_the_forged_header_is_valid_when_not_tampered_with() -> None:
    state = ss.decode(forge(valid_header(), struct.pack("<2f", 1.0, 2.0)))
    assert torch.equal(state.params["w"], torch.tensor([1.0, 2.0]))


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_input_raises_bad_stage_state(case: str) -> None:
    with pytest.raises(BadStageState):
        ss.decode(HOSTILE[case])


def test_size_limit_is_checked_before_anything_else() -> None:
    data = ss.encode(sample_state())
    with pytest.raises(BadStageState, match="over the limit"):
        ss.decode(data, max_bytes=len(data) - 1)
    assert ss.decode(data, max_bytes=len(data)).step == 2


def test_every_truncation_is_refused() -> None:
    data = ss.encode(sample_state())
    for n in list(range(0, 200)) + list(range(200, len(data), 97)):
        with pytest.raises(BadStageState):
            ss.decode(data[:n])


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=2048))
def test_random_bytes_raise_bad_stage_state(data: bytes) -> None:
    with pytest.raises(BadStageState):
        ss.decode(data)
    with pytest.raises(BadStageState):
        ss.decode(ss.MAGIC + bytes([ss.VERSION]) + data)


_VALID = ss.encode(StageState(stage=0, step=1, model_hash=HASH,
                              params={"w": torch.arange(6.0).reshape(2, 3),
                                      "b": torch.tensor([True, False])},
                              optimizer={"state": {0: {"step": torch.tensor(1.0)}},
                                         "param_groups": [{"lr": 0.1, "betas": (0.9, 0.99),
                                                           "params": [0, 1]}]},
                              meta={"samples": 3}))


@settings(max_examples=400, deadline=None)
@given(st.lists(st.tuples(st.integers(0, len(_VALID) - 1), st.integers(0, 255)), min_size=1,
                max_size=4),
       st.integers(0, len(_VALID)), st.binary(max_size=16))
def test_mutated_encodings_decode_or_raise_bad_stage_state(
        flips: list[tuple[int, int]], cut: int, tail: bytes) -> None:
    data = bytearray(_VALID)
    for pos, value in flips:
        data[pos] = value
    for candidate in (bytes(data), bytes(data[:cut]) + tail):
        try:
            state = ss.decode(candidate)
        except BadStageState:
            continue
        assert isinstance(state, StageState)  # a flip inside tensor bytes is still well-formed


DTYPE_NAMES = st.one_of(st.sampled_from(sorted(ss.DTYPES)), st.text(max_size=8))
DIMS = st.one_of(st.integers(0, 4), st.integers(-3, 2 ** 62))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(DTYPE_NAMES, st.lists(DIMS, max_size=10)), max_size=4),
       st.integers(0, 64))
# found by this test: an empty tensor whose other dims overflow torch's stride calculation
@example([("bfloat16", [0, 1288, 4151, 1_725_127_230_597])], 0)
def test_forged_tensor_tables_never_allocate_or_escape(table: list[tuple[str, list[int]]],
                                                       data_len: int) -> None:
    header = valid_header(tensors=[[d, s] for d, s in table],
                          params=[[f"p{i}", ref(i)] for i in range(len(table))])
    try:
        state = ss.decode(forge(header, b"\0" * data_len))
    except BadStageState:
        return
    assert sum(t.numel() * t.element_size() for t in state.params.values()) == data_len


# ---- checkpoints ------------------------------------------------------------------------

def test_checkpoint_round_trip_keeps_one_file_per_stage(tmp_path: Path) -> None:
    assert load_checkpoint(tmp_path / "none", 1) is None
    first = sample_state(stage=1, step=2)
    path = save_checkpoint(tmp_path, first)
    assert path == tmp_path / "stage-1.swst"
    second = sample_state(stage=1, step=4)
    assert save_checkpoint(tmp_path, second) == path
    save_checkpoint(tmp_path, sample_state(stage=3, step=1))
    assert sorted(os.listdir(tmp_path)) == ["stage-1.swst", "stage-3.swst"]
    loaded = load_checkpoint(tmp_path, 1)
    assert loaded is not None and loaded.step == 4
    assert same_tensors(dict(loaded.params), dict(second.params))
    assert ckpt.saved_stages(tmp_path) == [1, 3]
    assert ckpt.checkpoint_dir(Path("/h")) == Path("/h/checkpoints")


@pytest.mark.parametrize("fail_at", ["fsync", "replace", "interrupt"])
def test_a_crash_while_saving_keeps_the_old_checkpoint(tmp_path: Path, fail_at: str,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    old = sample_state(stage=0, step=2)
    save_checkpoint(tmp_path, old)

    def boom(*args: Any, **kwargs: Any) -> None:
        if fail_at == "interrupt":
            raise KeyboardInterrupt
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(ckpt.os, "fsync" if fail_at != "replace" else "replace", boom)
    with pytest.raises((OSError, KeyboardInterrupt)):
        save_checkpoint(tmp_path, sample_state(stage=0, step=9))
    monkeypatch.undo()
    assert os.listdir(tmp_path) == ["stage-0.swst"], "no temporary file may be left behind"
    loaded = load_checkpoint(tmp_path, 0)
    assert loaded is not None and loaded.step == 2


def test_temp_files_of_a_killed_writer_are_ignored_then_removed(tmp_path: Path) -> None:
    save_checkpoint(tmp_path, sample_state(stage=0, step=2))
    stale = tmp_path / f".stage-0.swst.tmp-{os.getpid()}-dead"
    stale.write_bytes(b"half written")
    assert ckpt.saved_stages(tmp_path) == [0]
    assert load_checkpoint(tmp_path, 0).step == 2  # type: ignore[union-attr]
    save_checkpoint(tmp_path, sample_state(stage=0, step=3))
    assert not stale.exists()


def corrupt_case(path: Path, how: str) -> None:
    data = bytearray(path.read_bytes())
    if how == "bit flip in payload":
        data[len(data) // 2] ^= 0x10
    elif how == "bit flip in digest":
        data[20] ^= 0x01
    elif how == "truncated":
        data = data[:len(data) - 100]
    elif how == "truncated header":
        data = data[:30]
    elif how == "bad magic":
        data[0:4] = b"JUNK"
    elif how == "empty":
        data = bytearray()
    elif how == "trailing bytes":
        data += b"\0"
    path.write_bytes(bytes(data))


EXPECTED = {"bit flip in payload": "checksum", "bit flip in digest": "checksum",
            "truncated": "truncated", "truncated header": "shorter than its header",
            "bad magic": "not a swarmd checkpoint", "empty": "truncated",
            "trailing bytes": "trailing bytes"}


@pytest.mark.parametrize("how", sorted(EXPECTED))
def test_corruption_is_detected_with_a_clear_message(tmp_path: Path, how: str) -> None:
    path = save_checkpoint(tmp_path, sample_state(stage=2))
    corrupt_case(path, how)
    with pytest.raises(CorruptCheckpoint) as err:
        load_checkpoint(tmp_path, 2)
    text = str(err.value)
    assert err.value.code == "corrupt_checkpoint" and err.value.path == path
    assert str(path) in text and EXPECTED[how] in text and "from peers" in text, text


def test_valid_checksum_over_invalid_contents_or_another_stage(tmp_path: Path) -> None:
    payload = b"not a stage state"
    import hashlib
    (tmp_path / "stage-4.swst").write_bytes(ckpt.HEADER.pack(
        ckpt.MAGIC, ckpt.VERSION, len(payload), hashlib.blake2b(payload, digest_size=32).digest())
        + payload)
    with pytest.raises(CorruptCheckpoint, match="contents are invalid"):
        load_checkpoint(tmp_path, 4)
    os.replace(save_checkpoint(tmp_path, sample_state(stage=2)), tmp_path / "stage-5.swst")
    with pytest.raises(CorruptCheckpoint, match="holds stage 2, not 5"):
        load_checkpoint(tmp_path, 5)


def test_quarantine_sets_the_file_aside_and_keeps_a_few(tmp_path: Path) -> None:
    for i in range(ckpt.KEEP_QUARANTINED + 2):
        path = save_checkpoint(tmp_path, sample_state(stage=1))
        corrupt_case(path, "truncated")
        with pytest.raises(CorruptCheckpoint):
            load_checkpoint(tmp_path, 1)
        moved = quarantine(path, now=1_700_000_000 + 3600 * i)
        assert moved.name.startswith("stage-1.swst.corrupt-2023")
        assert load_checkpoint(tmp_path, 1) is None  # absent now: fetched from peers next
    names = sorted(os.listdir(tmp_path))
    assert len(names) == ckpt.KEEP_QUARANTINED and all(".corrupt-" in n for n in names)
    assert ckpt.saved_stages(tmp_path) == []
    again = quarantine(save_checkpoint(tmp_path, sample_state(stage=1)),
                       now=1_700_000_000 + 3600 * (ckpt.KEEP_QUARANTINED + 1))
    assert again.name.endswith("-2"), "a second quarantine in the same second gets a new name"


# ---- mixed precision: the float32 master weights travel ---------------------------------

def bf16_stage(seed: int, width: int = 8, steps: int = 2) -> tuple[torch.nn.Module, Any]:
    from swarmd.training.swarm_optim import OptimSettings, SwarmOptimizer

    torch.manual_seed(seed)
    module = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Linear(width, 4)
                                 ).to(torch.bfloat16)
    optimizer = SwarmOptimizer(module.parameters(), OptimSettings(name="adamw", lr=1e-2),
                               dtype=torch.bfloat16)
    gen = torch.Generator().manual_seed(seed + 1)
    for _ in range(steps):
        module(torch.randn(5, width, generator=gen).bfloat16()).float().pow(2).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    return module, optimizer


def test_a_bf16_stage_state_carries_its_float32_masters_and_the_next_step_matches() -> None:
    """A bfloat16 stage's parameters are only the rounding of its float32 masters: a joiner
    that took the parameters alone (before: masters rebuilt from them) stepped from other
    weights than its mate and drifted apart at once."""
    ahead, opt_ahead = bf16_stage(0)
    state = ss.decode(ss.encode(ss.capture(ahead, opt_ahead, stage=0, step=2, model_hash=HASH)))
    behind, opt_behind = bf16_stage(7, steps=0)
    ss.restore(state, behind, opt_behind, stage=0, model_hash=HASH)
    assert all(torch.equal(a, b) for a, b in zip(opt_ahead.master.masters,
                                                 opt_behind.master.masters))
    x = torch.linspace(-1, 1, 40).reshape(5, 8).bfloat16()
    for module, optimizer in ((ahead, opt_ahead), (behind, opt_behind)):
        module(x).float().pow(2).sum().backward()
        optimizer.step()
    assert all(torch.equal(a, b) for a, b in zip(opt_ahead.master.masters,
                                                 opt_behind.master.masters))
    assert same_tensors(ahead.state_dict(), behind.state_dict())


@pytest.mark.parametrize("bad", ["count", "dtype", "shape", "not a list"])
def test_a_state_with_bad_masters_is_refused_and_changes_nothing(bad: str) -> None:
    ahead, opt_ahead = bf16_stage(0)
    state = ss.capture(ahead, opt_ahead, stage=0, step=2, model_hash=HASH)
    masters = list(state.optimizer["masters"])
    forged = {"count": masters[:-1], "dtype": [masters[0].double(), *masters[1:]],
              "shape": [masters[0][:1], *masters[1:]], "not a list": {"0": masters[0]}}[bad]
    bad_state = StageState(stage=0, step=2, model_hash=HASH, params=state.params,
                           optimizer={**state.optimizer, "masters": forged})
    behind, opt_behind = bf16_stage(7, steps=0)
    before = {k: v.clone() for k, v in behind.state_dict().items()}
    with pytest.raises(StateMismatch, match="master"):
        ss.restore(bad_state, behind, opt_behind, stage=0, model_hash=HASH)
    assert same_tensors(before, behind.state_dict())


def test_a_bf16_stages_encoded_state_fits_the_bound_a_joiner_allows() -> None:
    """A bfloat16 module's optimizer state is float32 (moments and masters): 14 bytes per
    parameter against the module's 2. The bound counted copies of the module's own bytes
    (8 per parameter plus slack) and refused such a state from a peer once the stage was a
    few MB."""
    module, optimizer = bf16_stage(0, width=2048, steps=1)
    low, high = ss.state_bytes_bound(module)
    size = len(ss.encode(ss.capture(module, optimizer, stage=0, step=1, model_hash=HASH)))
    assert low <= size <= high
