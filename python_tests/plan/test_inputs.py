"""The runtime model's inputs as users write them: model sizes in billions (``7B``) and the link
inside a node of several GPUs when it is left out (NVLink-class, not the inter-node rate)."""

import json

import pytest

from dlion_kernels.plan import model
from dlion_kernels.plan.__main__ import main

NODE = dict(inter_gbps=25, fwd_ms=80, bwd_ms=160)


def test_billions_as_model_sizes_are_written():
    assert model.parse_size("7B") == 7_000_000_000
    assert model.parse_size("1.3b") == model.parse_size("1.3G") == 1_300_000_000
    with pytest.raises(ValueError, match="unknown unit 'X'.*B: billions"):
        model.parse_size("12X")


def test_cli_takes_billions(capsys):
    assert main(["--params", "1B", "--ranks", "8", "--inter-gbps", "10", "--fwd-ms", "80",
                 "--bwd-ms", "160", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["inputs"]["params"] == 1_000_000_000


def _steps(**kw):
    return {r.strategy: r.step_ms for r in model.predict("1B", 32, 8, **NODE, **kw)}


def test_intra_node_link_defaults_to_nvlink_class_on_multi_gpu_nodes():
    default = _steps()
    assert default == _steps(intra_gbps=model.DEFAULT_INTRA_GBPS)
    assert model.DEFAULT_INTRA_GBPS >= 1000  # NVLink-class, far above any NIC
    # the old default (the inter-node rate) ranked sharded and hierarchical strategies behind
    # the fp32 all-reduce; with a node's own fabric they come first
    slow_node = _steps(intra_gbps=NODE["inter_gbps"])
    assert slow_node["fsdp-dlion-overlap"] > slow_node["lion-allreduce"]
    assert default["fsdp-dlion-overlap"] < default["lion-allreduce"] / 2
    assert default["dlion-vote-hier-overlap"] < default["lion-allreduce"] / 2


def test_one_rank_per_node_needs_no_intra_link():
    rows = model.predict("124M", 8, 1, **NODE)
    same = model.predict("124M", 8, 1, intra_gbps=NODE["inter_gbps"], **NODE)
    assert [r.step_ms for r in rows] == [r.step_ms for r in same]


def test_cli_states_the_default_it_used(capsys):
    assert main(["--params", "124M", "--ranks", "16", "--ranks-per-node", "8", "--inter-gbps",
                 "25", "--fwd-ms", "80", "--bwd-ms", "160", "--json"]) == 0
    inputs = json.loads(capsys.readouterr().out)["inputs"]
    assert inputs["intra_gbps"] == model.DEFAULT_INTRA_GBPS
    with pytest.raises(SystemExit):
        main(["--help"])
    assert f"{model.DEFAULT_INTRA_GBPS:g}, NVLink-class" in capsys.readouterr().out
