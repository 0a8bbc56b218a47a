"""Hugging Face causal LMs cut into stages: the stage-split model computes what the real
transformers model computes, in one process (codec none: activations handed over as they are)."""

from __future__ import annotations

import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch

transformers = pytest.importorskip("transformers")

from swarmd.models.hf import HFCausalLM  # noqa: E402
from swarmd.models.weights import Checkpoint  # noqa: E402
from swarmd.models.registry import model_seam_of

VOCAB, T, B = 101, 12, 3


def llama_config(**over):  # type: ignore[no-untyped-def]
    args = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=4,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return transformers.LlamaConfig(**(args | over))


def gpt2_config(**over):  # type: ignore[no-untyped-def]
    args = dict(vocab_size=VOCAB, n_embd=32, n_layer=4, n_head=4, n_positions=64,
                embd_pdrop=0.0, resid_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    return transformers.GPT2Config(**(args | over))


def qwen2_config():  # type: ignore[no-untyped-def]
    return transformers.Qwen2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=48,
                                    num_hidden_layers=4, num_attention_heads=4,
                                    num_key_value_heads=2, max_position_embeddings=64,
                                    tie_word_embeddings=True)


def mistral_config():  # type: ignore[no-untyped-def]
    return transformers.MistralConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48,
                                      num_hidden_layers=4, num_attention_heads=4,
                                      num_key_value_heads=2, max_position_embeddings=64,
                                      sliding_window=8)  # shorter than T: the window matters


def qwen3_config():  # type: ignore[no-untyped-def]
    return transformers.Qwen3Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=48,
                                    num_hidden_layers=4, num_attention_heads=4,
                                    num_key_value_heads=2, head_dim=8,
                                    max_position_embeddings=64)


CONFIGS = {"llama": llama_config, "gpt2": gpt2_config, "qwen2": qwen2_config,
           "qwen3": qwen3_config, "mistral": mistral_config}


def split(seam: HFCausalLM, num_stages: int, seed: int = 0):  # type: ignore[no-untyped-def]
    return (seam.build_trainer(seed=seed),
            [seam.build_stage(i, num_stages, seed=seed) for i in range(num_stages)])


def reference(seam: HFCausalLM, trainer, stages):  # type: ignore[no-untyped-def]
    """The real *ForCausalLM holding the split model's very weights."""
    torch.manual_seed(1)
    ref = transformers.AutoModelForCausalLM.from_config(seam.config)
    state = {}
    for part in (trainer, *stages):
        own = part.state_dict()
        state |= {remote: own[local] for local, remote in seam.checkpoint_names(part).items()}
    missing, unexpected = ref.load_state_dict(state, strict=False)
    assert not unexpected
    assert set(missing) <= ({"lm_head.weight"} if seam.tied else set())
    return ref


def batch(seed: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(VOCAB, (B, T + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def split_loss(trainer, stages, x, y, *, handover=lambda t: t):  # type: ignore[no-untyped-def]
    """Trainer embeds, each stage runs on a detached copy of its input (as over the wire), the
    head computes the loss; backward hop by hop, as the pipeline does. Token ids (stage 0
    holding the embedding) travel as they are and take no gradient."""
    hidden = trainer.embed(x)
    inputs, outputs, h = [], [], hidden
    for stage in stages:
        arrived = handover(h.detach())
        if arrived.is_floating_point():
            arrived.requires_grad_(True)
        inputs.append(arrived)
        h = stage(arrived)
        outputs.append(h)
    last = handover(h.detach()).requires_grad_(True)
    loss = trainer.loss(trainer.head(last), y)
    loss.backward()
    grad = last.grad
    for stage_in, stage_out in zip(reversed(inputs), reversed(outputs)):
        stage_out.backward(handover(grad))
        grad = stage_in.grad
    if hidden.requires_grad:
        hidden.backward(grad)
    else:
        assert grad is None and not hidden.is_floating_point()
    return loss.detach()


def over_the_wire(t: torch.Tensor) -> torch.Tensor:
    """What a hop with codec none does: wire_tensor, encode, bytes, decode."""
    from swarmd.models.gpt import wire_tensor
    from transport import codecs
    from transport.limits import Limits

    encoded = codecs.encode(wire_tensor(t), codecs.CodecSpec(name="none"))
    payload = memoryview(b"".join(bytes(part) for part in encoded.parts))
    return codecs.decode(encoded.meta(), payload, Limits())


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_stage_split_gradients_equal_the_transformers_model(family: str) -> None:
    seam = HFCausalLM(CONFIGS[family]())
    trainer, stages = split(seam, 2)
    ref = reference(seam, trainer, stages)
    x, y = batch()
    loss = split_loss(trainer, stages, x, y, handover=over_the_wire)
    ref_loss = trainer.loss(ref(input_ids=x).logits, y)
    ref_loss.backward()
    assert rel_err(loss, ref_loss.detach()) <= 1e-5
    ref_params = dict(ref.named_parameters())
    worst, compared = 0.0, 0
    for part in (trainer, *stages):
        own = dict(part.named_parameters())
        for local, remote in seam.checkpoint_names(part).items():
            assert own[local].grad is not None, local
            worst = max(worst, rel_err(own[local].grad, ref_params[remote].grad))
            compared += 1
    assert compared == len(ref_params)  # every parameter of the model, each once
    assert worst <= 1e-5, f"{family}: largest relative gradient error {worst:.3g}"


def test_each_stage_holds_only_its_layers_and_init_is_deterministic() -> None:
    seam = HFCausalLM(llama_config())
    before = torch.random.get_rng_state()
    first = seam.build_stage(1, 2, seed=5)
    assert torch.equal(torch.random.get_rng_state(), before)  # no global RNG used
    assert sorted(first.layers) == ["2", "3"]
    again = HFCausalLM(llama_config()).build_stage(1, 2, seed=5)
    other_cut = seam.build_stage(2, 4, seed=5)  # layer 2 alone
    for name, tensor in first.state_dict().items():
        assert torch.equal(tensor, again.state_dict()[name]), name
    for name, tensor in other_cut.state_dict().items():
        assert torch.equal(tensor, first.state_dict()[name]), name
    buffers = dict(first.named_buffers())
    assert buffers and all(torch.equal(t, dict(again.named_buffers())[n])
                           for n, t in buffers.items())
    assert first.rotary_emb.inv_freq.dtype == torch.float32
    reseeded = seam.build_stage(1, 2, seed=6)
    assert not torch.equal(reseeded.layers["2"].mlp.up_proj.weight,
                           first.layers["2"].mlp.up_proj.weight)


def test_fingerprint_names_the_setting_that_differs() -> None:
    from swarmd.errors import ModelMismatch
    from swarmd.models.seam import check_fingerprint

    ours = HFCausalLM(llama_config()).fingerprint(dtype="bfloat16", optimizer="lamb")
    theirs = HFCausalLM(llama_config(num_key_value_heads=4)).fingerprint(dtype="bfloat16",
                                                                           optimizer="lamb")
    assert ours.hash != theirs.hash
    check_fingerprint(ours, ours.hash, ours.fields)  # equal: nothing raised
    with pytest.raises(ModelMismatch, match="hf.num_key_value_heads: 2 here vs 4 there"):
        check_fingerprint(ours, theirs.hash, theirs.fields)
    other_opt = HFCausalLM(llama_config()).fingerprint(dtype="bfloat16", optimizer="adamw")
    with pytest.raises(ModelMismatch, match="optimizer: 'lamb' here vs 'adamw' there"):
        check_fingerprint(ours, other_opt.hash, other_opt.fields)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_pretrained_slices_load_only_their_own_tensors(tmp_path, family: str) -> None:
    torch.manual_seed(0)
    config = CONFIGS[family]()
    ref = transformers.AutoModelForCausalLM.from_config(config)
    ref.save_pretrained(tmp_path, max_shard_size="40KB")  # several shards and an index
    shards = sorted(tmp_path.glob("*.safetensors"))
    assert len(shards) > 2 and (tmp_path / "model.safetensors.index.json").is_file()
    weight_map = json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]

    seam = HFCausalLM.from_dir(tmp_path)
    checkpoints = [Checkpoint(tmp_path) for _ in range(3)]
    trainer = seam.build_trainer(weights=checkpoints[0])
    stages = [seam.build_stage(i, 2, weights=checkpoints[1 + i]) for i in range(2)]
    for part, checkpoint in zip((trainer, *stages), checkpoints):
        own_bytes = sum(t.numel() * t.element_size() for t in
                        {id(p): p for p in part.state_dict().values()}.values()
                        if t.is_floating_point())
        if seam.tied:  # the head's weight is the embedding's: read once
            own_bytes -= trainer.lm_head.weight.numel() * 4 if part is trainer else 0
        assert checkpoint.tensor_bytes_read == own_bytes  # its own tensors, nothing else
        own_shards = {tmp_path / weight_map[n] for n in seam.checkpoint_names(part).values()}
        assert set(checkpoint.files_opened) == own_shards  # and only the shards holding them
        assert len(checkpoint.files_opened) < len(shards)
    x, y = batch()
    with torch.no_grad():
        h = trainer.embed(x)
        for stage in stages:
            h = stage(h)
        loss = trainer.loss(trainer.head(h), y)
        ref_loss = trainer.loss(ref(input_ids=x).logits, y)
    assert rel_err(loss, ref_loss) <= 1e-4


def test_bfloat16_stages_keep_float32_rotary_frequencies() -> None:
    seam = HFCausalLM(llama_config())
    spec = seam.activation(B, T, torch.bfloat16)
    for index in (0, 1):  # stage 0 looks token ids up, stage 1 takes activations
        stage = seam.build_stage(index, 2, dtype=torch.bfloat16)
        assert all(p.dtype == torch.bfloat16 for p in stage.parameters())
        assert stage.rotary_emb.inv_freq.dtype == torch.float32
        out = stage(batch()[0] if index == 0 else torch.randn(spec.shape, dtype=spec.dtype))
        assert out.shape == spec.shape and out.dtype == spec.dtype and torch.isfinite(out).all()


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_stage_0_holds_an_untied_embedding_and_the_trainer_sends_token_ids(family: str) -> None:
    """Untied rotary models: ``embed_tokens`` is stage 0's (the same initial values the
    trainer's had), the trainer's ``embed`` hands the ids on; tied models and GPT-2 keep it
    with the head."""
    seam = HFCausalLM(CONFIGS[family]())
    trainer, stages = split(seam, 2)
    x, _ = batch()
    names = {n for part in (trainer, *stages) for n in seam.checkpoint_names(part).values()}
    embedding = [n for n in names if n.endswith("embed_tokens.weight") or n.endswith("wte.weight")]
    assert len(embedding) == 1
    if seam.stage0_embeds:
        assert family != "gpt2" and not seam.tied
        assert torch.equal(trainer.embed(x), x)
        assert "model.embed_tokens.weight" in seam.checkpoint_names(stages[0]).values()
        assert not any("embed" in n for n in seam.checkpoint_names(trainer).values())
    else:
        assert family == "gpt2" or seam.tied
        assert trainer.embed(x).shape == (B, T, seam.width)


def test_tokenizer_in_the_model_directory_must_fit_its_vocabulary(tmp_path) -> None:
    from swarmd.errors import ModelError
    from swarmd.training.tokens import check_fits, load_tokenizer, train_bpe

    transformers.AutoModelForCausalLM.from_config(llama_config()).config.save_pretrained(tmp_path)
    train_bpe(["some text to learn from, " * 50, "more words here"], 280, tmp_path)
    seam = HFCausalLM.from_dir(tmp_path)
    assert seam.checkpoint() is None  # a config alone: random initialisation
    with pytest.raises(ModelError, match=rf"tokenizer.json: the tokenizer's vocabulary of 2[0-9][0-9] "
                                         rf"tokens does not fit the model's {VOCAB}"):
        check_fits(load_tokenizer(str(tmp_path)), seam.vocab_size, model="the model")


def test_model_hf_takes_its_directorys_tokenizer_unless_data_tokenizer_says_otherwise(
        tmp_path) -> None:
    from swarmd.config import load_config
    from swarmd.training.tokens import BPETokenizer, ByteTokenizer, train_bpe

    model = tmp_path / "model"
    transformers.AutoModelForCausalLM.from_config(
        llama_config(vocab_size=300)).config.save_pretrained(model)
    plain = load_config(None, {"SWARMD_MODEL_HF": str(model)}, {})
    assert isinstance(model_seam_of(plain)[1], ByteTokenizer)  # no tokenizer.json: bytes
    path = train_bpe(["some text to learn from, " * 50, "more words here"], 280, model)
    config = load_config(None, {"SWARMD_MODEL_HF": str(model), "SWARMD_SWARM_NAME": "hf-tok"},
                         {})
    seam, tok = model_seam_of(config)  # what `swarmd train` and `swarmd join` use
    assert isinstance(tok, BPETokenizer) and tok.path == path
    forced = load_config(None, {"SWARMD_MODEL_HF": str(model), "SWARMD_DATA_TOKENIZER": "bytes",
                                "SWARMD_SWARM_NAME": "hf-bytes"}, {})
    assert isinstance(model_seam_of(forced)[1], ByteTokenizer)
