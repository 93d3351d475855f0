"""CPU offload (FSDP2's CPUOffloadPolicy) in the memory model, the cost model and the planner: the states leave the GPU
for the host (exact bytes for a small Llama), the host's memory is checked per node, the copies and the host's
optimizer step are priced from their bytes, and the planner offloads when pinned, when nothing fits without it, or
when it beats the best setup without it (searched only where its bound says it can)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from llmctl.errors import DoesNotFitError, InputError
from llmctl.plan import comm as cm
from llmctl.plan import memory as mem
from llmctl.plan import offload as ol
from llmctl.plan import planner as pl
from llmctl.plan.emit import to_plan
from llmctl.plan.request import build_request
from llmctl.plan.timing import evaluate
from llmctl.spec.decisions import on_command
from llmctl.spec.hardware import resolve_gpu
from llmctl.spec.models import from_hf_config, resolve_model
from llmctl.spec.planfile import plan_to_yaml
from llmctl.spec.setup import MemoryLevers, TrainSetup
from llmctl.units import GIB
from tests.family_configs import LLAMA_256

TINY = from_hf_config(LLAMA_256, name="tiny")
ON = MemoryLevers(offload=True)


def _setup(**kw) -> TrainSetup:
    return TrainSetup(**{"gpus_per_node": 2, "seq_len": 256, **kw})


# --- memory --------------------------------------------------------------------------------------------------------
def test_the_states_move_to_the_host_and_the_gpu_holds_a_layer_in_flight() -> None:
    """Two ranks, bf16-mixed AdamW: 1,615,104 parameters, 725,504 a block. Per rank the host holds the fp32 master
    shard (4 B), its gradient (4 B) and both moments (8 B) = 16 x 807,552 bytes; the GPU instead one block's shard
    copied in (362,752 x (4 B fp32 + 2 B bf16 cast)) and one block's gradient shard before its copy out (x 4 B)."""
    off, on = mem.estimate(TINY, _setup()), mem.estimate(TINY, _setup(levers=ON))
    assert (TINY.params, TINY.params_per_layer) == (1_615_104, 725_504)
    assert [(c.name, c.bytes) for c in on.host_components] == [
        ("parameters (fp32 master, sharded)", 3_230_208),
        ("bf16 weights", 0),
        ("gradients (fp32)", 3_230_208),
        ("optimizer states (adamw)", 6_460_416),
    ]
    assert on.host_bytes == 16 * 807_552 == off.model_state_bytes and on.host_node_bytes == 2 * on.host_bytes
    assert on.model_state_bytes == 0 and off.host_bytes == 0 and not off.host_components
    gpu = {c.name: c.bytes for c in on.components}
    assert gpu[mem.OFFLOAD_COPY_IN] == 362_752 * 6 == 2_176_512
    assert gpu[mem.OFFLOAD_GRAD_OUT] == 362_752 * 4 == 1_451_008

    def states(ph: str) -> int:  # the states live on the GPU in that phase without offload
        return sum(c.bytes for c in off.components if c.bytes_per_param is not None and ph in c.phases)

    # One micro-batch a step: no gradient lives before the backward (the engine frees them after each step).
    assert states("forward") == states("loss_backward") == off.model_state_bytes - 3_230_208
    assert states("backward") == off.model_state_bytes
    assert on.phase_bytes == {
        "forward": off.phase_bytes["forward"] - states("forward") + 2_176_512,
        "loss_backward": off.phase_bytes["loss_backward"] - states("loss_backward") + 2_176_512,
        "backward": off.phase_bytes["backward"] - states("backward") + 2_176_512 + 1_451_008,
        "optimizer": 0,  # the step runs on the host
    }
    # fp32 training copies the fp32 shard with no cast.
    fp32 = mem.estimate(TINY, _setup(precision="fp32", levers=ON))
    assert {c.name: c.bytes for c in fp32.components}[mem.OFFLOAD_COPY_IN] == 362_752 * 4


def test_offload_is_fsdp2s() -> None:
    with pytest.raises(InputError, match="CPU offload is FSDP2's"):
        mem.estimate(TINY, _setup(engine="zero", levers=ON))


def test_a_node_without_enough_host_memory_does_not_fit() -> None:
    """llama-3.1-70b on one node of 8 A100-80GB with full checkpointing: 18.5 GiB per GPU (3.9 of them the root
    module's embeddings and LM head, which FSDP2 keeps unsharded from forward to backward), but 16 B a parameter on
    the host is 1,051 GiB per node, over the catalog's 128 GiB per GPU (AWS p4de's 144 GiB less the OS's part)."""
    spec, a100 = resolve_model("llama-3.1-70b"), resolve_gpu("A100-80GB")
    setup = TrainSetup(gpus_per_node=8, checkpointing="full", attention="flash", levers=ON)
    est = mem.estimate(spec, setup)
    cap = mem.host_capacity_bytes(a100, 8)
    assert cap == 128 * GIB and est.host_bytes == 16 * spec.params // 8
    assert round(est.host_node_bytes / GIB) == 1051 and est.device_bytes < 19 * GIB
    assert mem.fits(est, a100.memory_bytes) and not mem.fits(est, a100.memory_bytes, cap)
    assert mem.max_micro_batch(spec, setup, a100.memory_bytes, host_memory_bytes=cap) == 0
    # A node with 2 TB (DGX A100 640GB; a cluster file's node_memory_gib) holds it; bf16 moments: 12 B a parameter.
    assert mem.fits(est, a100.memory_bytes, mem.host_capacity_bytes(a100, 8, node_memory_gib=2048))
    bf16 = mem.estimate(spec, replace(setup, optimizer_states="bf16"))
    assert bf16.host_bytes == 12 * spec.params // 8 and mem.fits(bf16, a100.memory_bytes, cap)
    # Two nodes halve each node's share: the fewest GPUs with offload is 16.
    m = mem.min_gpus(spec, setup, a100.memory_bytes, "full_shard", host_memory_bytes=cap)
    assert (m.gpus, m.nodes) == (16, 2)
    report = mem.fit_report(spec, setup, a100)
    assert report["fits"] is False and report["offload"]["host_fits"] is False
    assert report["offload"]["host_capacity_bytes_per_node"] == 1024 * GIB
    # A kind whose node the catalog does not know is not checked.
    assert mem.host_capacity_bytes(resolve_gpu("L40S"), 8) is None


# --- cost ----------------------------------------------------------------------------------------------------------
def test_copy_and_host_step_terms_are_bytes_over_bandwidth() -> None:
    """A100-80GB: PCIe 4.0 x16, 32 GB/s x 0.8; the host's DRAM 35.2 GB/s per GPU (p4de) x 0.7. One rank's shard of
    llama-3.1-8b over 8 GPUs: copied in twice per micro-batch (forward, and again for backward), its gradient out
    once; AdamW on the host streams 28 B a parameter and the norm and clip 12 more; an addition 12."""
    spec, a100 = resolve_model("llama-3.1-8b"), resolve_gpu("A100-80GB")
    setup = TrainSetup(gpus_per_node=8, grad_accum_steps=4, levers=ON)
    t = ol.offload_time(a100, spec, setup, 1.0, 2.0, [], 0.8)
    shard = spec.params / 8
    link, dram = 32 * 0.8e9, 35.2 * 0.7e9
    assert (t.host_link_gbytes_s, t.host_memory_gbytes_s) == pytest.approx((25.6, 24.64))
    assert t.host_to_device_s == pytest.approx(2 * 4 * shard / link)  # a mutant without the backward copy: half
    assert t.device_to_host_s == pytest.approx(4 * shard / link)
    assert t.optimizer_s == pytest.approx((28 + 12) * shard / dram)
    assert t.accumulate_s == pytest.approx(12 * shard / dram)
    assert t.host_s == pytest.approx(t.optimizer_s + 3 * t.accumulate_s)  # 3 micro-batches after the first


def test_copies_join_the_collectives_chain_and_later_copies_are_not_hidden() -> None:
    """No compute to hide behind and no collectives (one GPU): every copy is exposed. Forward: each micro-batch
    copies every shard in (h). Backward: the copy-in again (h), beside the copy-out (d) on the other direction of
    PCIe; from the second micro-batch on the copy-out is synchronous (d more). So 2 micro-batches: 2h + h + (h + d)."""
    spec, gpu = resolve_model("llama-3.2-1b"), resolve_gpu("A100-80GB")
    setup = TrainSetup(grad_accum_steps=2, levers=ON)
    t = ol.offload_time(gpu, spec, setup, 0.0, 0.0, [], 0.8)
    h, d = t.host_to_device_s / 2, t.device_to_host_s
    assert t.copies_exposed_s == pytest.approx(4 * h + d)
    # With long compute windows and overlap 1, the asynchronous copies hide and only the synchronous one shows.
    hidden = ol.offload_time(gpu, spec, setup, 100.0, 100.0, [], 1.0)
    assert hidden.copies_exposed_s == pytest.approx(d)
    # Beside an all-gather of 1 s per micro-batch each way: forward's chain is h + 1 s, not max(h, 1 s).
    ag = [
        cm.CommOp(f"all-gather ({ph})", "all_gather", "intra", 8, 1.0, 2, ph, 1.0, 1.0)
        for ph in ("forward", "backward")
    ]
    with_ag = ol.offload_time(gpu, spec, setup, 0.0, 0.0, ag, 0.8)
    assert with_ag.copies_exposed_s == pytest.approx(4 * h + d)


def test_the_step_adds_what_offload_costs() -> None:
    req = _request("llama-3.1-8b", "A100-80GB", 8)
    base = req.candidate(micro_batch_size=2, grad_accum_steps=8, checkpointing="full", attention="flash")
    off, on = evaluate(req, base), evaluate(req, replace(base, levers=ON))
    p = on.predicted
    assert off.predicted.offload_s == 0 and off.predicted.offload is None and "offload" not in off.as_dict()
    assert p.offload_s == pytest.approx(p.offload.exposed_s) and p.offload_s > p.offload.optimizer_s > 0
    assert p.step_time_s == pytest.approx(p.compute_s + p.comm_exposed_s + p.offload_s)
    # the GPU's optimizer step moves to the host (offload.optimizer_s): the rest of the compute is the same
    assert p.split["framework"] < off.predicted.split["framework"]
    gpu_step = off.predicted.split["framework"] - p.split["framework"]
    assert (
        p.compute_s == pytest.approx(off.predicted.compute_s - gpu_step) and p.step_time_s > off.predicted.step_time_s
    )
    assert on.label.endswith("+ CPU offload") and on.as_dict()["offload"] is True


# --- planner -------------------------------------------------------------------------------------------------------
def _request(model: str, gpu: str, gpus: int, **extra):
    options = {
        "params": None,
        "gpu": gpu,
        "gpus": gpus,
        "nodes": None,
        "gpus_per_node": None,
        "cluster": None,
        "net": None,
        "intra_gbps": None,
        "inter_gbps": None,
        "seq_len": None,
        "global_batch": None,
        "global_batch_tokens": None,
        "tokens": None,
        "price": None,
        "objective": "throughput",
        "precision": "auto",
        "loss_chunk": None,
        "attention": None,
        "overlap": 0.8,
        "calibrate": None,
        **extra,
    }
    names = {d.param: d.name for d in on_command(TrainSetup, "plan")}
    decisions = {names[k]: options.pop(k) for k in list(options) if k in names}
    return build_request(model, options, decisions)[0]


def test_70b_on_8_a100_fits_only_with_offload_and_bf16_moments() -> None:
    """llama-3.1-70b full fine-tuning on one node of 8 A100-80GB: 16 B a parameter over 8 GPUs is 131 GiB each, so
    nothing fits without offload; with it the host needs 1,051 GiB per node, over the catalog's 1,024, and with bf16
    moments 788 GiB. The planner says why at each step."""
    with pytest.raises(DoesNotFitError) as e:
        pl.plan(_request("llama-3.1-70b", "A100-80GB", 8))
    assert "with CPU offload" in e.value.message and "host memory 1,051 GiB per node" in e.value.message
    assert "--optimizer-states bf16" in (e.value.hint or "")
    # --no-offload alone is no setup pin: the refusal names the fewest GPUs that fit without offload
    with pytest.raises(
        DoesNotFitError, match=r"the smallest cluster of A100-80GB that fits is 2 nodes x 8 \(16 GPUs\)"
    ):
        pl.plan(_request("llama-3.1-70b", "A100-80GB", 8, optimizer_states="bf16", offload=False))
    r = pl.plan(_request("llama-3.1-70b", "A100-80GB", 8, optimizer_states="bf16"))
    assert {c.setup.levers.offload for c in r.variants} == {True}
    assert r.offload_choice.startswith("on: no setup fits the GPUs without it (llama-3.1-70b does not fit")
    assert "788 GiB per node (98.6 GiB per GPU) of 1,024 GiB" in r.offload_choice
    assert r.chosen.predicted.memory_per_gpu_bytes <= 80 * GIB and r.as_dict(3)["offload_choice"] == r.offload_choice
    assert "\n  offload: true\n" in plan_to_yaml(to_plan(r))


def test_a_node_with_the_memory_fits_fp32_moments(tmp_path) -> None:
    cluster = tmp_path / "dgx.yaml"
    cluster.write_text("gpu: A100-80GB\nnodes: 1\ngpus_per_node: 8\nnode_memory_gib: 1900\n")
    r = pl.plan(_request("llama-3.1-70b", None, None, cluster=str(cluster)))
    assert r.chosen.setup.levers.offload and r.chosen.setup.states_dtype == "fp32"
    assert "1,051 GiB per node (131.4 GiB per GPU) of 1,900 GiB" in r.offload_choice


def test_offload_wins_where_the_states_squeeze_the_setups_without_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """llama-3.1-70b on 2 nodes of 8 A100-80GB (400 Gbps): without offload, with the default memory margin, only TP 8
    at micro-batch 1 with full checkpointing fits (CP 2 x TP 8 before the engine's final norm + LM head unit freed the
    embeddings' 2 GiB); with it full_shard at micro-batch 16 does (the default batch for 70B, 2M tokens: 1,024
    sequences), about nine times as fast. A family's fastest setup, which does not fit without offload,
    plus the host's step beats the best without it, so the planner searches both and says why; for llama-3.1-8b on
    8 H100 none does: one search."""
    searches: list[bool | None] = []
    plan_once = pl._plan

    def counted(req, offload_pinned=True):
        searches.append(req.pin("offload"))
        return plan_once(req, offload_pinned)

    monkeypatch.setattr(pl, "_plan", counted)
    req = _request("llama-3.1-70b", "A100-80GB", None, nodes=2, inter_gbps=400)
    r = pl.plan(req)
    s = r.chosen.setup
    assert (
        searches == [None, True] and s.levers.offload and (s.tp, s.micro_batch_size, s.grad_accum_steps) == (1, 16, 4)
    )
    without = "on: the best setup without it (FULL_SHARD over 2 nodes x TP 8, mb 1 x 512, full checkpointing)"
    assert r.offload_choice.startswith(without)
    assert "predicts 89% fewer tokens/s" in r.offload_choice
    assert offload_adds_at_least_its_host_step(req, r)
    searches.clear()
    free = pl.plan(_request("llama-3.1-8b", "H100-SXM", 8))
    assert searches == [None] and not free.chosen.setup.levers.offload


def offload_adds_at_least_its_host_step(req, r: pl.PlanResult) -> bool:
    """What llmctl.plan.search.offload_can_win stands on: every offload setup's step is at least the same setup's
    without offload, less its GPU optimizer step, plus the host's optimizer step."""
    for c in r.variants:
        twin = evaluate(req, replace(c.setup, levers=MemoryLevers())).predicted
        gpu_step = twin.split["framework"] - c.predicted.split["framework"]
        if c.predicted.step_time_s < twin.step_time_s - gpu_step + c.predicted.offload.optimizer_s - 1e-9:
            return False
    return True


def test_offload_only_when_it_can_win_or_pinned() -> None:
    free = pl.plan(_request("llama-3.1-8b", "H100-SXM", 8))
    assert not any(c.setup.levers.offload for c in free.variants) and free.offload_choice == ""
    assert "offload_choice" not in free.as_dict(3) and "offload" not in plan_to_yaml(to_plan(free))
    pinned = pl.plan(_request("llama-3.1-8b", "H100-SXM", 8, offload=True))
    assert {c.setup.levers.offload for c in pinned.variants} == {True}
    assert pinned.offload_choice.startswith("on as pinned (--offload); each GPU holds")
    assert pinned.chosen.predicted.tokens_per_s < free.chosen.predicted.tokens_per_s
