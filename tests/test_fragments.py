"""plan_fragments (docs/algorithms.md section 5, "Fragments"): strided and sequential
patterns, the rest of the model in fragment 0 or on its own, explicit lists, tied
weights, the gather/scatter round trip and the manifest check.

The toy model has width d = 2, so every size below is countable by hand:
  embed.weight          10 x 2 = 20
  blocks.i.lin.weight    2 x 2 =  4   } block i: 4 + 2 + 2 + 2 = 10, i = 0..5
  blocks.i.lin.bias          2 =  2   }
  blocks.i.norm.weight       2 =  2   }
  blocks.i.norm.bias         2 =  2   }
  norm.weight, norm.bias   2 + 2 = 4
  total 20 + 6 * 10 + 4 = 84
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
from torch import nn

from diloco.fragments import plan_fragments

D, VOCAB, NBLOCKS = 2, 10, 6


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)
        self.norm = nn.LayerNorm(D)


class Toy(nn.Module):
    def __init__(self, tied: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D)
        self.blocks = nn.ModuleList(Block() for _ in range(NBLOCKS))
        self.norm = nn.LayerNorm(D)
        if tied:
            self.head = nn.Linear(D, VOCAB, bias=False)
            self.head.weight = self.embed.weight  # one Parameter, two names


REST = ["embed.weight", "norm.weight", "norm.bias"]


def block_names(i: int) -> list[str]:
    return [f"blocks.{i}.{n}" for n in ("lin.weight", "lin.bias", "norm.weight", "norm.bias")]


def blocks_of(names: list[str]) -> set[int]:
    return {int(n.split(".")[1]) for n in names if n.startswith("blocks.")}


def rest_of(names: list[str]) -> list[str]:
    return [n for n in names if not n.startswith("blocks.")]


def model(seed: int = 0, **kwargs) -> Toy:
    torch.manual_seed(seed)
    return Toy(**kwargs)


# -- patterns -----------------------------------------------------------------------------------


def test_strided_p3():
    plan = plan_fragments(model(), 3)
    assert len(plan) == 3
    # block i goes to fragment i % 3; the rest joins fragment 0
    assert [blocks_of(f.names) for f in plan.fragments] == [{0, 3}, {1, 4}, {2, 5}]
    assert rest_of(plan[0].names) == REST
    assert rest_of(plan[1].names) == rest_of(plan[2].names) == []
    # names keep the model's registration order
    assert plan[0].names == ["embed.weight", *block_names(0), *block_names(3), *REST[1:]]
    # sizes: 20 + 2 * 10 + 4 = 44; 2 * 10 = 20; 20; total 84
    assert [f.numel for f in plan.fragments] == [44, 20, 20]
    assert [f.index for f in plan.fragments] == [0, 1, 2]


def test_strided_is_the_default_pattern():
    a = plan_fragments(model(), 3)
    b = plan_fragments(model(), 3, pattern="strided")
    assert a.describe() == b.describe()


def test_sequential_p3():
    plan = plan_fragments(model(), 3, pattern="sequential")
    # block i goes to fragment i * 3 // 6: 0, 0, 1, 1, 2, 2
    assert [blocks_of(f.names) for f in plan.fragments] == [{0, 1}, {2, 3}, {4, 5}]
    assert rest_of(plan[0].names) == REST
    assert [f.numel for f in plan.fragments] == [44, 20, 20]


def test_uneven_split():
    # P = 4 over 6 blocks. Strided: i % 4 -> {0, 4}, {1, 5}, {2}, {3}.
    plan = plan_fragments(model(), 4)
    assert [blocks_of(f.names) for f in plan.fragments] == [{0, 4}, {1, 5}, {2}, {3}]
    # Sequential: i * 4 // 6 for i = 0..5 -> 0, 0, 1, 2, 2, 3.
    plan = plan_fragments(model(), 4, pattern="sequential")
    assert [blocks_of(f.names) for f in plan.fragments] == [{0, 1}, {2}, {3, 4}, {5}]


def test_separate_rest_p4():
    plan = plan_fragments(model(), 4, separate_rest=True)
    assert len(plan) == 4  # the rest fragment is counted in P
    assert plan[0].names == REST
    # 3 block fragments, strided i % 3, shifted to indices 1..3
    assert [blocks_of(f.names) for f in plan.fragments[1:]] == [{0, 3}, {1, 4}, {2, 5}]
    assert all(rest_of(f.names) == [] for f in plan.fragments[1:])
    assert [f.numel for f in plan.fragments] == [24, 20, 20, 20]  # 20 + 4; 2 * 10 each
    assert [f.index for f in plan.fragments] == [0, 1, 2, 3]


def test_one_fragment_holds_everything():
    m = model()
    plan = plan_fragments(m, 1)
    assert plan[0].names == [n for n, _ in m.named_parameters()]
    assert plan[0].numel == 84


def test_unknown_pattern():
    with pytest.raises(ValueError, match="pattern must be 'strided' or 'sequential'"):
        plan_fragments(model(), 2, pattern="random")


# -- plans that do not fit ------------------------------------------------------------------------


def test_more_fragments_than_blocks():
    with pytest.raises(ValueError, match=r"fragments \(P\) = 7 .* 6 repeated blocks"):
        plan_fragments(model(), 7)
    # with a separate rest, 7 = 1 + 6 fits, 8 = 1 + 7 does not
    assert len(plan_fragments(model(), 7, separate_rest=True)) == 7
    with pytest.raises(ValueError, match="separate rest fragment"):
        plan_fragments(model(), 8, separate_rest=True)


def test_model_without_blocks():
    flat = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    with pytest.raises(ValueError, match=r"no repeated blocks .*fragments \(P\) must be 1"):
        plan_fragments(flat, 2)
    plan = plan_fragments(flat, 1)
    assert plan[0].names == ["0.weight", "0.bias", "1.weight", "1.bias"]
    assert plan[0].numel == 12  # 2 * (4 + 2)


def test_named_blocks_attribute_must_be_a_module_list():
    with pytest.raises(ValueError, match="'norm' is not an nn.ModuleList"):
        plan_fragments(model(), 2, blocks_attr="norm")
    plan = plan_fragments(model(), 2, blocks_attr="blocks")
    assert [blocks_of(f.names) for f in plan.fragments] == [{0, 2, 4}, {1, 3, 5}]


# -- explicit lists --------------------------------------------------------------------------------


def explicit_lists() -> list[list[str]]:
    return [
        REST + block_names(0) + block_names(1),
        block_names(2) + block_names(3),
        block_names(4) + block_names(5),
    ]


def test_explicit_valid():
    lists = explicit_lists()
    plan = plan_fragments(model(), 3, explicit=lists)
    assert [f.names for f in plan.fragments] == lists  # order as given
    assert [f.numel for f in plan.fragments] == [44, 20, 20]


def test_explicit_missing_parameter():
    lists = explicit_lists()
    lists[2].remove("blocks.5.norm.bias")
    with pytest.raises(ValueError, match=r"in no fragment: \['blocks.5.norm.bias'\]"):
        plan_fragments(model(), 3, explicit=lists)


def test_explicit_duplicate():
    lists = explicit_lists()
    lists[1].append("embed.weight")
    with pytest.raises(ValueError, match="'embed.weight' listed twice"):
        plan_fragments(model(), 3, explicit=lists)


def test_explicit_unknown_name():
    lists = explicit_lists()
    lists[0].append("blocks.9.lin.weight")
    with pytest.raises(ValueError, match="no parameter named 'blocks.9.lin.weight'"):
        plan_fragments(model(), 3, explicit=lists)


def test_explicit_wrong_count():
    with pytest.raises(ValueError, match=r"3 lists given for fragments \(P\) = 2"):
        plan_fragments(model(), 2, explicit=explicit_lists())


def test_explicit_empty_fragment():
    lists = explicit_lists()
    lists[1] = []
    lists[2] = block_names(2) + block_names(3) + block_names(4) + block_names(5)
    with pytest.raises(ValueError, match="fragment 1 is empty"):
        plan_fragments(model(), 3, explicit=lists)


# -- tied weights ------------------------------------------------------------------------------------


def test_tied_weights_listed_once():
    m = model(tied=True)
    assert m.head.weight is m.embed.weight
    plan = plan_fragments(m, 3)
    names = [n for f in plan.fragments for n in f.names]
    assert "embed.weight" in names
    assert "head.weight" not in names  # the shared Parameter appears under one name
    assert len(names) == len(set(names)) == 1 + 6 * 4 + 2  # 27 tensors
    # numel counts the shared 10 x 2 once: still 84
    assert sum(f.numel for f in plan.fragments) == 84
    assert sum(p.numel() for p in m.parameters()) == 84
    # writing fragment 0 moves both the embedding and the head
    plan.scatter(m, 0, torch.zeros(plan[0].numel))
    assert torch.equal(m.head.weight, torch.zeros(VOCAB, D))


# -- gather / scatter -------------------------------------------------------------------------------


def snapshot(m: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in m.named_parameters()}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_scatter_of_gather_is_identity(dtype):
    m = model().to(dtype)
    plan = plan_fragments(m, 3)
    before = snapshot(m)
    for i in range(len(plan)):
        flat = plan.gather(m, i)
        assert flat.dtype == torch.float32 and flat.device.type == "cpu"
        assert flat.shape == (plan[i].numel,)
        plan.scatter(m, i, flat)
    after = snapshot(m)
    for name, value in before.items():
        assert after[name].dtype == dtype
        assert torch.equal(after[name], value), name


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_gather_after_scatter_returns_the_vector(dtype):
    m = model().to(dtype)
    plan = plan_fragments(m, 3)
    # 0, 1, ..., 43: small integers are exact in bf16 (8 significant bits: up to 256)
    v = torch.arange(plan[0].numel, dtype=torch.float32)
    plan.scatter(m, 0, v)
    assert torch.equal(plan.gather(m, 0), v)
    # the layout is the name order: embed.weight takes 0..19 as a 10 x 2 matrix,
    # blocks.0.lin.weight the next 4, blocks.0.lin.bias the next 2
    assert torch.equal(m.embed.weight.float(), torch.arange(20.0).view(10, 2))
    assert torch.equal(m.blocks[0].lin.weight.float(), torch.tensor([[20.0, 21.0], [22.0, 23.0]]))
    assert torch.equal(m.blocks[0].lin.bias.float(), torch.tensor([24.0, 25.0]))
    # blocks 0 and 3 (20 values) follow embed; the final norm takes the last 4: 40..43
    assert torch.equal(m.norm.bias.float(), torch.tensor([42.0, 43.0]))
    # other fragments are untouched
    other = model().to(dtype)
    assert torch.equal(m.blocks[1].lin.weight, other.blocks[1].lin.weight)


def test_gather_into_out_buffer():
    m = model()
    plan = plan_fragments(m, 3)
    out = torch.full((plan[1].numel,), -1.0)
    got = plan.gather(m, 1, out=out)
    assert got is out
    assert torch.equal(out, plan.gather(m, 1))


# -- describe / check_against ------------------------------------------------------------------------


def test_describe_shape():
    plan = plan_fragments(model(), 3)
    described = plan.describe()
    assert [d["index"] for d in described] == [0, 1, 2]
    assert [d["numel"] for d in described] == [44, 20, 20]
    assert described[1]["params"][0] == {"name": "blocks.1.lin.weight", "shape": [2, 2]}
    assert described[1]["params"][1] == {"name": "blocks.1.lin.bias", "shape": [2]}


def test_check_against_identical_plan_passes():
    plan = plan_fragments(model(), 3)
    plan.check_against(plan.describe())
    # as the manifest stores it: through JSON
    plan.check_against(json.loads(json.dumps(plan.describe())))
    # another worker with the same architecture and different weights
    plan.check_against(plan_fragments(model(seed=1), 3).describe())


def test_check_against_renamed_parameter():
    plan = plan_fragments(model(), 3)
    run = copy.deepcopy(plan.describe())
    run[1]["params"][2]["name"] = "blocks.1.ln.weight"
    with pytest.raises(ValueError) as info:
        plan.check_against(run)
    msg = str(info.value)
    assert "fragment 1" in msg
    assert "blocks.1.norm.weight" in msg and "blocks.1.ln.weight" in msg


def test_check_against_changed_shape():
    plan = plan_fragments(model(), 3)
    run = copy.deepcopy(plan.describe())
    run[2]["params"][0]["shape"] = [3, 2]  # blocks.2.lin.weight is 2 x 2 in the model
    with pytest.raises(ValueError) as info:
        plan.check_against(run)
    msg = str(info.value)
    assert "fragment 2" in msg and "blocks.2.lin.weight" in msg
    assert "[2, 2]" in msg and "[3, 2]" in msg


def test_check_against_different_model_width():
    wide = nn.Module()
    wide.embed = nn.Embedding(VOCAB, 3)  # 10 x 3 where the run has 10 x 2
    plan = plan_fragments(wide, 1)
    run = [{"index": 0, "numel": 20, "params": [{"name": "embed.weight", "shape": [10, 2]}]}]
    with pytest.raises(ValueError, match=r"embed.weight \[10, 3\] where the run has"):
        plan.check_against(run)


def test_check_against_fragment_count():
    plan = plan_fragments(model(), 3)
    with pytest.raises(ValueError, match="3 fragments but the run has 2"):
        plan.check_against(plan_fragments(model(), 2).describe())


def test_check_against_names_a_missing_parameter():
    plan = plan_fragments(model(), 3)
    run = copy.deepcopy(plan.describe())
    run[1]["params"].append({"name": "blocks.1.extra", "shape": [2]})
    with pytest.raises(ValueError, match="blocks.1.extra"):
        plan.check_against(run)


def test_model_that_is_itself_a_module_list():
    """A bare nn.ModuleList of blocks: names are "0.weight", "1.weight", ..."""
    blocks = nn.ModuleList(nn.Linear(2, 2) for _ in range(4))
    plan = plan_fragments(blocks, 2)
    # strided: blocks 0 and 2 in fragment 0, 1 and 3 in fragment 1
    assert plan[0].names == ["0.weight", "0.bias", "2.weight", "2.bias"]
    assert plan[1].names == ["1.weight", "1.bias", "3.weight", "3.bias"]


# -- split tensors: every fragment 1/P of the parameters to within one block ---------------------
# P = 3, block 4 on the toy model: the whole-tensor order is fragment 0's parameters
# (embed 20, block 0 10, block 3 10, final norm 4), then fragment 1's (blocks 1, 4),
# then fragment 2's (blocks 2, 5); N = 84, cuts at floor(i * 84 / 3 / 4) * 4 = 28, 56.


def pieces(frag) -> list[tuple[str, int, int]]:
    return [(p.name, p.start, p.end) for p in frag.params]


def test_split_cuts_the_whole_tensor_order_into_equal_shares():
    plan = plan_fragments(model(), 3, split=True, block_size=4)
    assert [f.numel for f in plan.fragments] == [28, 28, 28]
    assert pieces(plan[0]) == [("embed.weight", 0, 20), ("blocks.0.lin.weight", 0, 4),
                               ("blocks.0.lin.bias", 0, 2), ("blocks.0.norm.weight", 0, 2)]
    # fragment 1 begins with block 0's last tensor and ends inside block 4's weight
    assert pieces(plan[1])[0] == ("blocks.0.norm.bias", 0, 2)
    assert pieces(plan[1])[-1] == ("blocks.4.lin.weight", 0, 2)
    assert pieces(plan[2])[0] == ("blocks.4.lin.weight", 2, 4)
    assert plan[2].names[-1] == "blocks.5.norm.bias"


@pytest.mark.parametrize("pattern", ["strided", "sequential"])
@pytest.mark.parametrize("separate_rest", [False, True])
@pytest.mark.parametrize("block", [1, 2, 4, 8])
def test_split_fragments_hold_n_over_p_within_one_block_and_cover_each_value_once(
        pattern, separate_rest, block):
    m = model()
    for p in range(2 if separate_rest else 1, 7 if separate_rest else 6):
        if p * block > 84:
            continue
        whole = plan_fragments(m, p, pattern=pattern, separate_rest=separate_rest)
        plan = plan_fragments(m, p, pattern=pattern, separate_rest=separate_rest,
                              split=True, block_size=block)
        sizes = [f.numel for f in plan.fragments]
        assert sum(sizes) == 84
        assert all(abs(n - 84 / p) < block for n in sizes), (p, block, sizes)
        # the split plan's vectors, end to end, are the whole-tensor plan's
        flat = torch.cat([plan.gather(m, i) for i in range(p)])
        assert torch.equal(flat, torch.cat([whole.gather(m, i) for i in range(p)]))


def test_split_scatter_writes_each_piece_where_it_belongs():
    m = model()
    plan = plan_fragments(m, 3, split=True, block_size=4)
    before = snapshot(m)
    plan.scatter(m, 2, torch.arange(28.0))
    # blocks.4.lin.weight holds values 2..3 of its flattened 2 x 2 in fragment 2
    w = m.blocks[4].lin.weight.detach()
    assert torch.equal(w.reshape(-1)[:2], before["blocks.4.lin.weight"].reshape(-1)[:2])
    assert torch.equal(w.reshape(-1)[2:], torch.tensor([0.0, 1.0]))
    assert torch.equal(m.blocks[4].lin.bias.detach(), torch.tensor([2.0, 3.0]))
    assert torch.equal(plan.gather(m, 2), torch.arange(28.0))
    assert torch.equal(m.blocks[1].lin.weight, before["blocks.1.lin.weight"])  # fragment 1


def test_split_refuses_a_non_contiguous_parameter_instead_of_writing_a_copy():
    m = model()
    m.blocks[4].lin.weight = nn.Parameter(torch.randn(2, 2).t())  # a transposed view
    plan = plan_fragments(m, 3, split=True, block_size=4)
    with pytest.raises(ValueError, match="blocks.4.lin.weight is not contiguous"):
        plan.scatter(m, 2, torch.zeros(28))


def test_split_never_applies_to_explicit_plans_or_one_fragment():
    m = model()
    explicit = [REST + block_names(0), [n for i in range(1, 6) for n in block_names(i)]]
    assert plan_fragments(m, 2, explicit=explicit, split=True).describe() == plan_fragments(
        m, 2, explicit=explicit).describe()
    assert plan_fragments(m, 1, split=True, block_size=4).describe() == plan_fragments(
        m, 1).describe()


def test_split_refuses_fragments_smaller_than_a_block():
    with pytest.raises(ValueError, match="fragment 0 would be empty"):
        plan_fragments(model(), 3, split=True, block_size=64)


def test_describe_names_a_slice_only_for_a_piece():
    plan = plan_fragments(model(), 3, split=True, block_size=4)
    described = plan.describe()
    assert described[1]["params"][-1] == {"name": "blocks.4.lin.weight", "shape": [2, 2],
                                          "slice": [0, 2]}
    assert described[2]["params"][1] == {"name": "blocks.4.lin.bias", "shape": [2]}
    # whole-tensor plans describe exactly as before: no slice anywhere
    whole = json.dumps(plan_fragments(model(), 3).describe())
    assert "slice" not in whole


def test_check_against_names_a_different_cut():
    split = plan_fragments(model(), 3, split=True, block_size=4)
    split.check_against(json.loads(json.dumps(split.describe())))
    with pytest.raises(ValueError) as info:
        split.check_against(plan_fragments(model(), 3).describe())  # a whole-tensor run
    # fragment 0 of the split plan stops after blocks.0.norm.weight
    assert str(info.value) == (
        "fragment 0: the run has parameter blocks.0.norm.bias [2] that the model lacks")
    run = copy.deepcopy(split.describe())
    run[2]["params"][0]["slice"] = [1, 4]
    with pytest.raises(ValueError) as info:
        split.check_against(run)
    assert str(info.value) == (
        "fragment 2: the model has parameter blocks.4.lin.weight [2, 2] [2:4] where the "
        "run has blocks.4.lin.weight [2, 2] [1:4]")
