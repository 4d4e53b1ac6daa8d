"""`hps checkpoint export`: a live root's checkpoint (plus its write-ahead log) as torch files
that a model and its torch.optim class load (issue 13)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ps.core.config import JobConfig, OptimizerConfig, ParamGroup
from ps.core.optim import group_defaults, group_index, optimizer_class
from ps.core.view import KeySpec, Layout
from ps.tools.cli import main
from tests.helpers import bsp_rounds
from worker import ParameterClient

CFG = OptimizerConfig(kind="adamw", lr=0.01, groups=(ParamGroup(("*.bias",), (("weight_decay", 0.0),)),))


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc = torch.nn.Linear(4, 3)
        self.bn = torch.nn.BatchNorm1d(3)
        self.bn.weight.requires_grad_(False)  # frozen


def _layout(net: torch.nn.Module) -> Layout:
    specs = [KeySpec(n, tuple(p.shape), kind="param" if p.requires_grad else "frozen")
             for n, p in net.named_parameters()]
    return Layout(specs + [KeySpec(n, tuple(b.shape), kind="buffer") for n, b in net.named_buffers()
                           if b.dtype == torch.float32])


def test_export_writes_what_the_root_holds_and_torch_loads_it(tree, tmp_path, capsys):
    ckpt = tmp_path / "ckpt"
    tree.add("root", "global", checkpoint_dir=str(ckpt), checkpoint_every=5)
    net = Net()
    layout = _layout(net)
    init = np.concatenate([net.state_dict()[s.key].numpy().ravel() for s in layout]).astype(np.float32)
    clients = [ParameterClient(tree.addr("root"), "j", f"w{i}", timeout_s=10) for i in range(2)]
    clients[0].create_job(JobConfig(name="j", optimizer=CFG), layout, init)
    for c in clients:
        c.register()
        c.pull()
    rng = np.random.default_rng(0)
    grads = rng.standard_normal((7, 2, layout.numel)).astype(np.float32)
    bsp_rounds(clients, 7, lambda i, s: grads[s, i])  # a checkpoint at version 5; 6 and 7 in the log only
    _, version, _, view = tree.view("root", "j")
    assert version == 7
    root_opt = tree.lt.call(lambda: tree.tier("root").jobs["j"].optimizer.torch_state_dict())

    assert main(["checkpoint", "export", str(ckpt), "--out", str(tmp_path / "m.pt"),
                 "--optimizer-out", str(tmp_path / "o.pt")]) == 0
    assert "version 7" in capsys.readouterr().out
    model = torch.load(tmp_path / "m.pt")
    assert list(model) == [s.key for s in layout]  # params, frozen and buffers
    assert np.concatenate([t.numpy().ravel() for t in model.values()]).tobytes() == view.tobytes()
    fresh = Net()
    fresh.load_state_dict(model, strict=False)  # num_batches_tracked (int) is not a key of the job
    trained = [(n, p) for n, p in fresh.named_parameters() if p.requires_grad]
    gi = group_index(CFG, [n for n, _ in trained])
    opt = optimizer_class(CFG.kind)([{"params": [p for (_, p), g in zip(trained, gi) if g == i], **d}
                                     for i, d in enumerate(group_defaults(CFG))])
    opt.load_state_dict(torch.load(tmp_path / "o.pt"))
    loaded = opt.state_dict()
    assert loaded["state"].keys() == root_opt["state"].keys() == {0, 1, 2}  # fc.weight, fc.bias, bn.bias
    for k, st in root_opt["state"].items():
        for name, value in st.items():
            assert torch.equal(loaded["state"][k][name], value), (k, name)
    assert [g["weight_decay"] for g in loaded["param_groups"]] == [0.01, 0.0]

    # The checkpoint alone: version 5, not the log's 6 and 7.
    assert main(["checkpoint", "export", str(ckpt / "j"), "--out", str(tmp_path / "m5.pt"), "--no-wal"]) == 0
    assert "version 5 (checkpoint only)" in capsys.readouterr().out
    assert not torch.equal(torch.load(tmp_path / "m5.pt")["fc.weight"], model["fc.weight"])
    # A backup named otherwise exports as its job (a root serves a directory only under its job's name).
    import shutil
    shutil.copytree(ckpt / "j", tmp_path / "j-20261127")
    assert main(["checkpoint", "export", str(tmp_path / "j-20261127"), "--out", str(tmp_path / "b.pt")]) == 0
    assert "version 7" in capsys.readouterr().out
    assert torch.equal(torch.load(tmp_path / "b.pt")["fc.weight"], model["fc.weight"])
    for c in clients:
        c.close()


def test_export_refuses_what_is_not_a_checkpoint(tmp_path, capsys):
    assert main(["checkpoint", "export", str(tmp_path), "--out", str(tmp_path / "m.pt")]) == 2
    assert "holds checkpoints of 0 jobs" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["checkpoint", "export", str(tmp_path)])  # --out is required
