"""`llmctl export`: engine checkpoints -> Hugging Face folders that `from_pretrained` loads.

Round trips on real checkpoints (2 gloo ranks, 3 steps): the exported model's logits equal those of a model built
independently from the same checkpoint (dcp_to_torch_save into the padded model), within 1e-5 in fp32, for a
Llama with a local tokenizer and a padded vocabulary and for a GPT-2 (tied embeddings, padded vocabulary). The
refusals, the crash in the middle and the bad inputs use checkpoints written here in one process with
`dcp.save({"model": state_dict})`, the layout the engine's Checkpointer writes.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
from typer.testing import CliRunner

from llmctl.cli.main import app
from llmctl.engine import export as ex
from llmctl.engine.checkpoint_files import write_marker
from llmctl.engine.model import base_spec, model_spec_for
from llmctl.errors import RuntimeFailure, describe
from llmctl.spec.planfile import load_plan
from tests.engine.conftest import CORPUS, REPO, TINY, check_ok, deep_update, engine_cmd, engine_env

SMALL_LLAMA = {"preset": "llama-tiny", "overrides": {**TINY["model"]["overrides"], "vocab_size": 300}}  # 320 padded
SMALL_GPT2 = {"preset": "gpt2-tiny", "overrides": {"n_layer": 2, "n_embd": 64, "n_head": 4, "vocab_size": 300}}
ONE_LINE = "llmctl: error: "


def plan_dict(folder: Path, model: dict[str, Any], extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """TINY (3 steps, a checkpoint at the last) with its model section replaced, not merged: GPT-2 takes none of
    the Llama overrides."""
    plan = deep_update(TINY, {"training": {"max_steps": 3}, "checkpoint": {"interval_steps": 3}, **(extra or {})})
    plan["model"] = dict(model)
    plan["logging"] = {"dir": str(folder / "logs"), "interval_steps": 1}
    plan["checkpoint"]["dir"] = str(folder / "ckpt")
    return plan


def write_plan_dict(folder: Path, plan: dict[str, Any]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "plan.yaml"
    path.write_text(yaml.safe_dump(plan, sort_keys=False))
    return path


def bpe_tokenizer(folder: Path, vocab: int = 300) -> Path:
    """A byte-level BPE tokenizer trained on the shipped corpus (nothing downloaded)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel()
    tok.train(
        [str(CORPUS / "stdlib-docstrings.txt")],
        trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<unk>", "<s>", "</s>"]),
    )
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    fast.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Real engine checkpoints: 3 steps on 2 gloo ranks of a Llama (local BPE tokenizer, vocabulary 300 padded to
    320) and of a GPT-2 (tied embeddings, 300 -> 320). Both runs at once: most of their time is start-up."""
    root = tmp_path_factory.mktemp("trained")
    tok = bpe_tokenizer(root / "tok")
    plans = {
        "llama": write_plan_dict(
            root / "llama", plan_dict(root / "llama", SMALL_LLAMA, {"data": {"tokenizer": str(tok)}})
        ),
        "gpt2": write_plan_dict(root / "gpt2", plan_dict(root / "gpt2", SMALL_GPT2)),
    }
    procs = [
        subprocess.Popen(
            engine_cmd(p, 2),
            cwd=REPO,
            env=engine_env(p.parent),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for p in plans.values()
    ]
    for proc in procs:
        out, err = proc.communicate(timeout=240)
        check_ok(subprocess.CompletedProcess(proc.args, proc.returncode, out, err))
    return plans


def export_cli(*args: str) -> Any:
    return CliRunner().invoke(app, ["export", *map(str, args)])


def assert_ok(result: Any) -> None:
    assert result.exit_code == 0, result.output


def assert_one_line(result: Any, *needles: str) -> str:
    """Exit 2 and one `llmctl: error:` line, the last of the output, holding every needle."""
    lines = result.output.strip().splitlines()
    errors = [line for line in lines if line.startswith(ONE_LINE)]
    assert result.exit_code == 2, result.output
    assert len(errors) == 1 and lines[-1] == errors[0] and "Traceback" not in result.output, result.output
    for n in needles:
        assert n in errors[0], errors[0]
    return errors[0]


BATCH = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))


def reference_logits(step_dir: Path, plan_path: Path, scratch: Path) -> torch.Tensor:
    """The checkpoint's model built without the exporter: DCP -> one torch.save file -> the padded HF model (as the
    engine builds it), logits over the real vocabulary."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    plan = load_plan(plan_path)
    dcp_to_torch_save(str(step_dir), str(scratch / "full.pt"))
    state = torch.load(scratch / "full.pt", weights_only=False)["model"]
    cfg = dict(model_spec_for(plan.model).hf_config)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(cfg.pop("model_type"), **cfg), dtype=torch.float32)
    model.load_state_dict(state, strict=True)
    with torch.no_grad():
        return model.eval()(BATCH).logits[..., : base_spec(plan.model).vocab_size]


def exported_logits(out: Path) -> torch.Tensor:
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, local_files_only=True)
    with torch.no_grad():
        return model.eval()(BATCH).logits


def safetensors_tensors(out: Path) -> dict[str, tuple[str, tuple[int, ...], torch.dtype]]:
    """name -> (file, shape, dtype) of every tensor in the folder's safetensors files."""
    found = {}
    for f in sorted(out.glob("*.safetensors")):
        with safe_open(f, "pt") as st:
            assert st.metadata() == {"format": "pt"}
            for k in st.keys():  # noqa: SIM118 - a safetensors handle, not a dict
                t = st.get_tensor(k)
                found[k] = (f.name, tuple(t.shape), t.dtype)
    return found


def save_pretrained_layout(out: Path, tmp: Path) -> dict[str, tuple[int, ...]]:
    """What transformers' own save_pretrained writes for the exported config: tensor names and shapes."""
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(out))
    model.save_pretrained(tmp)
    return {k: v[1] for k, v in safetensors_tensors(tmp).items()}


# --- round trips on real engine checkpoints ------------------------------------------------------------------------
@pytest.mark.dist
@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_round_trip_logits_equal(trained: dict[str, Path], name: str, tmp_path: Path) -> None:
    plan_path = trained[name]
    ckpt = plan_path.parent / "ckpt"
    out = tmp_path / "hf"
    result = export_cli(ckpt, "--out", out, "--max-shard-size", "200KiB")
    assert_ok(result)
    assert f"exported {ckpt}/step_00000003 (step 3) -> {out}" in result.output
    assert "vocabulary 300 (20 padding rows of the checkpoint's 320 dropped)" in result.output

    index = json.loads((out / ex.SAFE_INDEX).read_text())
    tensors = safetensors_tensors(out)
    assert set(index) == {"metadata", "weight_map"}
    assert index["weight_map"] == {k: v[0] for k, v in tensors.items()}
    nbytes = {k: torch.Size(shape).numel() * 4 for k, (_, shape, _) in tensors.items()}
    assert index["metadata"]["total_size"] == sum(nbytes.values())
    files = sorted({f for f, _, _ in tensors.values()})
    assert len(files) >= 2 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    for f in files:  # at most 200 KiB, unless one tensor alone is larger
        in_file = [k for k, v in tensors.items() if v[0] == f]
        assert sum(nbytes[k] for k in in_file) <= 200 * 1024 or len(in_file) == 1, (f, in_file)
    assert all(dtype == torch.float32 for _, _, dtype in tensors.values())

    config = json.loads((out / "config.json").read_text())
    assert config["vocab_size"] == 300 and config["dtype"] == "float32"
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == config["eos_token_id"]
    # Exactly the names and shapes save_pretrained writes (GPT-2: the tied lm_head.weight is not among them).
    assert {k: v[1] for k, v in tensors.items()} == save_pretrained_layout(out, tmp_path / "sp")
    if name == "gpt2":
        assert "lm_head.weight" not in tensors and config["tie_word_embeddings"] is True

    got = exported_logits(out)
    want = reference_logits(ckpt / "step_00000003", plan_path, tmp_path)
    assert got.shape == want.shape == (*BATCH.shape, 300)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)

    # The tokenizer the run trained with travels with the model (saved with save_pretrained): the plan's local BPE
    # folder for the Llama, llmctl's byte tokenizer for the GPT-2; either encodes the training text to the ids the
    # engine trained on.
    assert_encodes_as_trained(out, plan_path)
    if name == "llama":
        assert f"tokenizer: from {load_plan(plan_path).data.tokenizer}" in result.output
    else:
        assert "tokenizer: llmctl's byte tokenizer as a Hugging Face tokenizer" in result.output


def assert_encodes_as_trained(out: Path, plan_path: Path) -> None:
    """The exported tokenizer (AutoTokenizer, offline) turns the plan's training text into the engine's token stream
    ([BOS] doc [EOS] per document, llmctl.engine.data.open_stream), document by document."""
    from llmctl.data.check import expand_paths
    from llmctl.engine.data import iter_documents, open_stream

    data = load_plan(plan_path).data
    tok = AutoTokenizer.from_pretrained(out, local_files_only=True)
    trained_on = open_stream(data, data.paths, "train", "data.paths").tokens.tolist()
    ids: list[int] = []
    for doc in iter_documents(expand_paths(data.paths)):
        ids += [tok.bos_token_id, *tok(doc, add_special_tokens=False).input_ids, tok.eos_token_id]
    assert ids == trained_on


@pytest.mark.dist
def test_bf16_export(trained: dict[str, Path], tmp_path: Path) -> None:
    """--dtype bf16: every tensor bf16 (the checkpoint's fp32 values rounded), config.dtype bfloat16, so that
    from_pretrained's default dtype ("auto") loads it in bf16."""
    ckpt = trained["llama"].parent / "ckpt"
    out = tmp_path / "hf16"
    assert_ok(export_cli(ckpt / "step_00000003", "--out", out, "--dtype", "bf16"))
    tensors = safetensors_tensors(out)
    assert {dtype for _, _, dtype in tensors.values()} == {torch.bfloat16}
    assert set(f for f, _, _ in tensors.values()) == {"model.safetensors"} and not (out / ex.SAFE_INDEX).exists()
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    model = AutoModelForCausalLM.from_pretrained(out, local_files_only=True)
    assert model.dtype == torch.bfloat16
    fp32 = tmp_path / "hf32"
    assert_ok(export_cli(ckpt, "--out", fp32))
    reference = AutoModelForCausalLM.from_pretrained(fp32, dtype=torch.float32, local_files_only=True)
    for (k, a), b in zip(model.state_dict().items(), reference.state_dict().values(), strict=True):
        assert torch.equal(a, b.to(torch.bfloat16)), k


# --- checkpoints written here, in one process ------------------------------------------------------------------------
def make_checkpoint(
    folder: Path, model: dict[str, Any], plan_extra: dict[str, Any] | None = None, with_plan: bool = True
) -> tuple[Path, torch.nn.Module]:
    """A step folder in the engine's layout (DCP {"model": state_dict} + plan.yaml) of a random model built as the
    engine builds it (padded vocabulary)."""
    import torch.distributed.checkpoint as dcp

    plan_path = write_plan_dict(folder, plan_dict(folder, model, plan_extra))
    plan = load_plan(plan_path)
    torch.manual_seed(0)
    if plan.model.weights:
        net = AutoModelForCausalLM.from_pretrained(plan.model.weights, dtype=torch.float32)
        net.resize_token_embeddings(model_spec_for(plan.model).vocab_size, mean_resizing=False)
    else:
        cfg = dict(model_spec_for(plan.model).hf_config)
        net = AutoModelForCausalLM.from_config(AutoConfig.for_model(cfg.pop("model_type"), **cfg), dtype=torch.float32)
    step = folder / "ckpt" / "step_00000007"
    dcp.save({"model": net.state_dict()}, checkpoint_id=str(step), no_dist=True)
    if with_plan:
        shutil.copy(plan_path, step / "plan.yaml")
    write_marker(step)  # what the engine's Checkpointer writes last: the export reads only folders llmctl wrote
    return step, net.eval()


@pytest.fixture(scope="module")
def small_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    step, _ = make_checkpoint(tmp_path_factory.mktemp("small"), SMALL_LLAMA)
    return step


def test_byte_tokenizer_round_trips_and_prompts_with_llmctls_chat_template(tmp_path: Path) -> None:
    """A run on instruction data prepared with llmctl's byte tokenizer (its plain chat template): the export holds a
    Hugging Face tokenizer that encodes text to the byte ids (BOS prepended, as the engine starts a document) and
    decodes them back, and whose apply_chat_template gives exactly the ids the run trained on (issue 49)."""
    from llmctl.data.chat import ChatRenderer, read_records
    from llmctl.data.format import open_prepared
    from llmctl.data.tokenizer import ByteTokenizer, load_tokenizer

    records = str(REPO / "examples" / "instruct" / "arithmetic.jsonl")
    data = tmp_path / "sft"
    prepared = CliRunner().invoke(
        app,
        ["data", "prepare", records, "--out", str(data), "--instruction", "--seq-len", "256", "--val-fraction", "0"],
    )
    assert_ok(prepared)
    step, _ = make_checkpoint(tmp_path / "run", SMALL_LLAMA, {"data": {"kind": "tokens", "paths": [str(data)]}})
    out = tmp_path / "hf"
    result = export_cli(step, "--out", out)
    assert_ok(result)
    assert "tokenizer: llmctl's byte tokenizer as a Hugging Face tokenizer, with llmctl's plain chat template" in (
        result.output
    )
    config = json.loads((out / "tokenizer_config.json").read_text())
    assert config["chat_template"].startswith("{{ bos_token") and config["tokenizer_class"] == "PreTrainedTokenizerFast"

    tok = AutoTokenizer.from_pretrained(out, local_files_only=True)
    text = "héllo\twörld 🙂 <|user|>\n"
    assert len(tok) == 258 and (tok.bos_token_id, tok.eos_token_id) == (256, 257)
    assert tok(text).input_ids == [256, *text.encode("utf-8")]
    assert tok.decode(tok(text).input_ids, skip_special_tokens=True) == text
    # The folder reads back as the byte tokenizer itself: data prepared with bytes stays valid for a model
    # fine-tuned from this export (examples/instruct-cpu.yaml fine-tunes the export of tiny-cpu.yaml's run).
    assert load_tokenizer(str(out)).fingerprint() == ByteTokenizer().fingerprint()

    first = next(read_records((records,))).messages
    want, _ = ChatRenderer(ByteTokenizer()).example("first", first)
    assert tok.apply_chat_template(first, tokenize=True, return_dict=False) == want.tolist()
    trained_on = open_prepared(data, "train")[0][0 : len(want)].tolist()  # the first pack starts with record 1
    assert trained_on == want.tolist()
    prompt = tok.apply_chat_template(first[:-1], add_generation_prompt=True, tokenize=False)
    assert prompt.endswith("<|assistant|>\n") and tok.decode(want.tolist()).startswith(prompt)


def test_a_tokenizer_folder_without_a_template_gets_the_plain_one_the_data_used(tmp_path: Path) -> None:
    """Instruction data prepared with a Hugging Face tokenizer that has no chat template was rendered with llmctl's
    plain template: the export saves that tokenizer (found through the prepared folder's meta.json, the plan naming
    no data.tokenizer) with the plain template, in that tokenizer's BOS/EOS: it renders the text the run trained on.
    (Only the text: the data tokenizes each turn apart so that no token straddles a prompt and its reply, and this
    BPE adds a prefix space at each start, so its ids for a whole conversation differ; the byte tokenizer's do not.)"""
    from llmctl.data.chat import ChatRenderer, read_records
    from llmctl.data.format import open_prepared
    from llmctl.data.tokenizer import HFTokenizer

    tok_dir = bpe_tokenizer(tmp_path / "tok")
    records = str(REPO / "examples" / "instruct" / "arithmetic.jsonl")
    data = tmp_path / "sft"
    args = ["data", "prepare", records, "--out", str(data), "--instruction", "--seq-len", "256", "--val-fraction", "0"]
    assert_ok(CliRunner().invoke(app, [*args, "--tokenizer", str(tok_dir)]))
    step, _ = make_checkpoint(tmp_path / "run", SMALL_LLAMA, {"data": {"kind": "tokens", "paths": [str(data)]}})
    out = tmp_path / "hf"
    result = export_cli(step, "--out", out)
    assert_ok(result)
    assert f"tokenizer: from {tok_dir}, with llmctl's plain chat template" in result.output
    tok = AutoTokenizer.from_pretrained(out, local_files_only=True)
    first = next(read_records((records,))).messages
    segments = ChatRenderer(HFTokenizer(str(tok_dir))).segments("first", first)
    trained_on = [t for ids, _ in segments for t in ids]
    assert open_prepared(data, "train")[0][0 : len(trained_on)].tolist() == trained_on
    plain = "".join(f"<|{m['role']}|>\n{m['content']}" + ("</s>" if m["role"] == "assistant" else "\n") for m in first)
    assert tok.apply_chat_template(first, tokenize=False) == "<s>" + plain  # llmctl.data.chat.PLAIN_TEMPLATE
    prompt = tok.apply_chat_template(first[:-1], add_generation_prompt=True, tokenize=False)
    assert prompt == "<s>" + plain[: plain.index("<|assistant|>\n") + len("<|assistant|>\n")]
    assert json.loads((out / "tokenizer_config.json").read_text())["chat_template"] == tok.chat_template


def test_export_is_quiet(small_ckpt: Path, tmp_path: Path) -> None:
    """No torchao native-library or pytree warnings (transformers imports torchao when it is installed): stderr
    holds the shard progress lines only (issue 49)."""
    out = tmp_path / "hf"
    r = subprocess.run(
        [sys.executable, "-m", "llmctl", "export", str(small_ckpt), "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=REPO,
    )
    assert r.returncode == 0, r.stderr
    lines = r.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("  [1/1] model.safetensors ("), r.stderr


def test_mixtral_experts_saved_per_expert(tmp_path: Path) -> None:
    """transformers 5 fuses Mixtral's experts in memory (what the engine checkpoints); the export writes them
    per expert, as save_pretrained does, and the folder loads to the same logits."""
    over = {"num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 96, "num_attention_heads": 4}
    over |= {"num_key_value_heads": 2, "num_local_experts": 2, "vocab_size": 300}
    step, net = make_checkpoint(tmp_path / "m", {"preset": "mixtral-8x7b", "overrides": over})
    out = tmp_path / "hf"
    assert_ok(export_cli(step, "--out", out, "--max-shard-size", "100KiB"))
    tensors = safetensors_tensors(out)
    assert "model.layers.0.block_sparse_moe.experts.1.w3.weight" in tensors, sorted(tensors)[:8]
    assert {k: v[1] for k, v in tensors.items()} == save_pretrained_layout(out, tmp_path / "sp")
    with torch.no_grad():
        want = net(BATCH).logits[..., :300]
    torch.testing.assert_close(exported_logits(out), want, atol=1e-5, rtol=0)


def test_weights_folder_config_and_generation_config(tmp_path: Path) -> None:
    """A plan that fine-tuned a local HF folder: config.json and generation_config.json start from its files."""
    cfg = AutoConfig.for_model(
        "llama", hidden_size=64, intermediate_size=96, num_hidden_layers=1, num_attention_heads=4, vocab_size=300
    )
    cfg.rope_parameters = {"rope_type": "default", "rope_theta": 123456.0}
    base = AutoModelForCausalLM.from_config(cfg)
    base.generation_config.max_length = 77
    base.save_pretrained(tmp_path / "base")
    step, net = make_checkpoint(tmp_path / "ft", {"weights": str(tmp_path / "base")})
    out = tmp_path / "hf"
    assert_ok(export_cli(step, "--out", out))
    config = json.loads((out / "config.json").read_text())
    assert config["rope_parameters"]["rope_theta"] == 123456.0 and config["vocab_size"] == 300
    assert json.loads((out / "generation_config.json").read_text())["max_length"] == 77
    with torch.no_grad():
        want = net(BATCH).logits[..., :300]
    torch.testing.assert_close(exported_logits(out), want, atol=1e-5, rtol=0)


def test_refuses_a_non_empty_out_and_force_replaces_only_an_export(small_ckpt: Path, tmp_path: Path) -> None:
    """--force replaces a folder an export wrote, never a user's (issue 46: it used to delete any non-empty folder,
    and a thesis.tex and a sub-folder went with it; this test failed on main then)."""
    out = tmp_path / "hf"
    (out / "chapters").mkdir(parents=True)
    (out / "thesis.tex").write_text("mine")
    (out / "chapters" / "one.tex").write_text("also mine")
    assert_one_line(export_cli(small_ckpt, "--out", out), f"--out {out}: folder is not empty", "--force")
    line = assert_one_line(export_cli(small_ckpt, "--out", out, "--force"))
    assert line == (
        f"llmctl: error: --out {out}: not a folder llmctl export wrote (no {ex.EXPORT_MARKER} in it); --force "
        "replaces only those (choose another folder; to replace this one, delete it yourself)"
    )
    assert sorted(str(p.relative_to(out)) for p in out.rglob("*")) == ["chapters", "chapters/one.tex", "thesis.tex"]
    assert (out / "thesis.tex").read_text() == "mine" and (out / "chapters" / "one.tex").read_text() == "also mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]

    export = tmp_path / "export"
    assert_ok(export_cli(small_ckpt, "--out", export))
    assert (export / ex.EXPORT_MARKER).is_file()
    (export / "stale.txt").write_text("from the previous export")
    assert_ok(export_cli(small_ckpt, "--out", export, "--force"))
    assert not (export / "stale.txt").exists() and (export / "model.safetensors").is_file()
    assert (export / ex.EXPORT_MARKER).is_file()  # still an export: the next --force may replace it again
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export", "hf"]  # no temporary or old folder beside it

    empty = tmp_path / "empty"
    empty.mkdir()
    assert_ok(export_cli(small_ckpt, "--out", empty))  # an empty folder is no folder to protect


@pytest.mark.parametrize("existing", [False, True])
def test_a_crash_mid_write_leaves_nothing_that_looks_complete(
    small_ckpt: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, existing: bool
) -> None:
    import safetensors.torch

    real = safetensors.torch.save_file
    calls = []

    def failing(*args: Any, **kwargs: Any) -> None:
        calls.append(args[1])
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        real(*args, **kwargs)

    monkeypatch.setattr(safetensors.torch, "save_file", failing)
    out = tmp_path / "hf"
    if existing:  # --force over a previous export: that one stays as it was
        out.mkdir()
        (out / "config.json").write_text("{}")
        (out / ex.EXPORT_MARKER).write_text("{}")
    request = ex.ExportRequest(checkpoint=small_ckpt, out=out, force=True, max_shard_bytes=100 * 1024)
    with pytest.raises(RuntimeFailure) as err:  # one line naming the file and the bytes (issue 46), exit 1
        ex.export_checkpoint(request)
    message, code = describe(err.value)
    assert code == 1 and "no space left on the device writing" in message and "model-00002-of-" in message
    assert "bytes" in message and "\n" not in message
    assert len(calls) == 2 and Path(calls[0]).parent.name.startswith(".hf.tmp-")
    if existing:
        assert sorted(p.name for p in out.iterdir()) == [ex.EXPORT_MARKER, "config.json"]
    assert sorted(p.name for p in tmp_path.iterdir()) == (["hf"] if existing else [])


def test_a_full_disk_is_one_line_naming_out(small_ckpt: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """safetensors reports a full disk in its own error type (the OS error only in its text): one line naming --out,
    exit 1, no temporary folder left (issue 46; it was "internal error ... a bug in llmctl" on main)."""
    import safetensors.torch

    class SafetensorError(Exception):  # its text, as safetensors wrote it on a full 64 KiB tmpfs
        pass

    def full(*args: Any, **kwargs: Any) -> None:
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(safetensors.torch, "save_file", full)
    out = tmp_path / "hf"
    result = export_cli(small_ckpt, "--out", out)
    assert result.exit_code == 1, result.output
    assert result.output.strip().splitlines()[-1] == (
        f"llmctl: error: {out}: no space left on device (free some space, or write it elsewhere)"
    )
    assert list(tmp_path.iterdir()) == []


def test_stale_temporary_folders_of_killed_exports_are_removed(small_ckpt: Path, tmp_path: Path) -> None:
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = tmp_path / f".hf.tmp-{int(dead.stdout)}"
    stale.mkdir()
    (stale / "model-00001-of-00002.safetensors").write_bytes(b"half")
    assert_ok(export_cli(small_ckpt, "--out", tmp_path / "hf"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]


def test_plan_flag_for_checkpoints_without_plan_yaml(tmp_path: Path) -> None:
    step, _ = make_checkpoint(tmp_path / "old", SMALL_LLAMA, with_plan=False)
    assert_one_line(export_cli(step, "--out", tmp_path / "hf"), f"{step} has no plan.yaml", "--plan PLAN")
    assert not (tmp_path / "hf").exists()
    result = export_cli(step.parent, "--out", tmp_path / "hf", "--plan", tmp_path / "old" / "plan.yaml")
    assert_ok(result)
    assert "(step 7)" in result.output and f"plan: {tmp_path / 'old' / 'plan.yaml'}" in result.output


def mismatched_plan(tmp_path: Path, overrides: dict[str, Any]) -> Path:
    model = {"preset": "llama-tiny", "overrides": {**SMALL_LLAMA["overrides"], **overrides}}
    return write_plan_dict(tmp_path / "other", plan_dict(tmp_path / "other", model))


@pytest.mark.parametrize(
    ("overrides", "needles"),
    [
        (
            {"intermediate_size": 96},
            ("model.layers.0.mlp.gate_proj.weight: the checkpoint holds shape [172, 64], the plan's model [96, 64]",),
        ),
        ({"vocab_size": 400}, ("model.embed_tokens.weight: the checkpoint holds shape [320, 64]", "[448, 64]")),
        (
            {"num_hidden_layers": 3},
            ("model.layers.2.self_attn.q_proj.weight: in the plan's model but missing from the checkpoint",),
        ),
        ({"num_hidden_layers": 1}, ("model.layers.1.", "in the checkpoint but not in the plan's model (+8 more)")),
    ],
)
def test_a_plan_that_does_not_match_the_checkpoint(
    small_ckpt: Path, tmp_path: Path, overrides: dict[str, Any], needles: tuple[str, ...]
) -> None:
    other = mismatched_plan(tmp_path, overrides)
    result = export_cli(small_ckpt, "--out", tmp_path / "hf", "--plan", other)
    assert_one_line(result, *needles, f"is {other} the plan that trained this checkpoint?")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["other"]


def corrupt(step: Path, how: str, tmp_path: Path) -> Path:
    bad = tmp_path / "bad" / "step_00000007"
    shutil.copytree(step, bad)
    if how == "metadata":
        (bad / ".metadata").write_bytes(b"not a pickle")
    else:
        shard = next(bad.glob("*.distcp"))
        shard.write_bytes(shard.read_bytes()[:1000])
    return bad


@pytest.mark.parametrize(
    ("setup", "needles"),
    [
        (lambda c, t: t / "nope", ("no such checkpoint",)),
        (lambda c, t: (t / "f").write_text("x") and t / "f", ("not a folder",)),
        (lambda c, t: (t / "e").mkdir() or t / "e", ("no complete step_* checkpoint",)),
        (lambda c, t: c.parent.parent, ("no complete step_* checkpoint", "(did you mean {c}?)")),
        (
            lambda c, t: (t / "p" / ".tmp-step_00000009").mkdir(parents=True) or t / "p",
            ("no complete step_* checkpoint (only an interrupted save: .tmp-step_00000009)",),
        ),
        (
            lambda c, t: (t / "s" / "step_00000002").mkdir(parents=True) or t / "s",
            ("step_00000002: not a torch.distributed.checkpoint folder (no .metadata file)",),
        ),
        (lambda c, t: corrupt(c, "metadata", t), (".metadata: 12 bytes, the save wrote", "is damaged")),
        (lambda c, t: corrupt(c, "shard", t), (".distcp: 1000 bytes, the save wrote", "is damaged")),
    ],
    ids=["missing", "file", "empty", "run-folder", "interrupted", "not-dcp", "bad-metadata", "truncated-shard"],
)
def test_bad_checkpoints_are_one_line(small_ckpt: Path, tmp_path: Path, setup: Any, needles: tuple[str, ...]) -> None:
    given = setup(small_ckpt, tmp_path)
    needles = tuple(n.replace("{c}", str(small_ckpt.parent)) for n in needles)
    assert_one_line(export_cli(given, "--out", tmp_path / "hf"), *needles)
    assert not (tmp_path / "hf").exists() and not list(tmp_path.glob(".hf.*"))


@pytest.mark.parametrize(
    ("args", "needles"),
    [
        (["--dtype", "fp16"], ("--dtype: unknown 'fp16'", "bf16 or fp32")),
        (["--max-shard-size", "lots"], ("bad --max-shard-size 'lots'",)),
        (["--max-shard-size", "0"], ("--max-shard-size must be positive",)),
        (["--plan", "nowhere.yaml"], ("nowhere.yaml: no such plan file",)),
    ],
)
def test_bad_options_are_one_line(small_ckpt: Path, tmp_path: Path, args: list[str], needles: tuple[str, ...]) -> None:
    assert_one_line(export_cli(small_ckpt, "--out", tmp_path / "hf", *args), *needles)
    assert not (tmp_path / "hf").exists()


def test_out_is_a_file_or_holds_the_checkpoint(small_ckpt: Path, tmp_path: Path) -> None:
    f = tmp_path / "file"
    f.write_text("x")
    assert_one_line(export_cli(small_ckpt, "--out", f, "--force"), "exists and is not a folder")
    run = small_ckpt.parent.parent  # the folder that holds ckpt/
    assert_one_line(export_cli(small_ckpt, "--out", run, "--force"), "holds the checkpoint being exported")
    assert small_ckpt.is_dir() and (small_ckpt / ".metadata").is_file()


def test_bad_input_fails_before_torch_is_imported(tmp_path: Path) -> None:
    code = (
        "import sys\nfrom llmctl.cli.main import main\n"
        f"sys.argv = ['llmctl', 'export', {str(tmp_path / 'nope')!r}, '--out', {str(tmp_path / 'o')!r}]\n"
        "try:\n    main()\nexcept SystemExit as e:\n    print('CODE', e.code, 'torch' in sys.modules, file=sys.stderr)\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert r.stderr.strip().splitlines() == [f"{ONE_LINE}{tmp_path / 'nope'}: no such checkpoint", "CODE 2 False"]


def test_plan_shards() -> None:
    """Greedy in order, like huggingface_hub: a tensor that would overflow starts the next file; one larger than
    the limit gets a file of its own."""
    sizes = [("a", 40), ("b", 50), ("c", 20), ("big", 300), ("d", 10), ("e", 100)]
    assert ex.plan_shards(sizes, 100) == [["a", "b"], ["c"], ["big"], ["d"], ["e"]]
    assert ex.plan_shards(sizes, 10**9) == [["a", "b", "c", "big", "d", "e"]]
    assert ex.plan_shards([], 100) == []
    assert [ex.shard_file_name(i, 3) for i in (1, 3)] == [
        "model-00001-of-00003.safetensors",
        "model-00003-of-00003.safetensors",
    ]
    assert ex.shard_file_name(1, 1) == "model.safetensors"
