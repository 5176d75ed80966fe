"""qkv.head_stats on a model whose heads are built by hand to be a previous-token head, a
sink head, an induction pair (a previous-token head feeding an induction head) and a
self-attending head; the other heads attend evenly, whose entropy is known exactly.

The model: one-hot token (V) and position (P) features, plus V features where layer 0's
previous-token head writes the token before each position; two layers of
:class:`qkv.nn.MultiHeadAttention` (4 heads of P features, causal, residual, no norm).
"""

from __future__ import annotations

import math
from typing import cast

import pytest
import torch
from torch import nn

import qkv
from qkv.nn import MultiHeadAttention

V, P, C = 16, 48, 60.0  # vocabulary, positions, the score of a chosen key
E = V + P + V  # token | position | previous token
TOKEN, POSITION, PREVIOUS = 0, V, V + P


class Heads(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(MultiHeadAttention(E, 4, head_dim=P) for _ in range(2))
        with torch.no_grad():
            for p in self.parameters():
                p.zero_()
            first, second = (cast(MultiHeadAttention, layer) for layer in self.layers)
            # layer 0, head 0: previous token. Query of position i is "position i − 1".
            for i in range(1, P):
                first.q_proj.weight[i - 1, POSITION + i] = C
            for j in range(P):
                first.k_proj.weight[j, POSITION + j] = 1.0
            for t in range(V):  # it copies the token it reads into the previous-token part
                first.v_proj.weight[t, TOKEN + t] = 1.0
                first.out_proj.weight[PREVIOUS + t, t] = 1.0
            # layer 0, head 1: sink. Every query asks for position 0.
            first.q_proj.weight[P, TOKEN : TOKEN + V] = C
            first.k_proj.weight[P, POSITION] = 1.0
            # layer 1, head 0: induction. Query "my token", key "the token before me".
            for t in range(V):
                second.q_proj.weight[t, TOKEN + t] = C
                second.k_proj.weight[t, PREVIOUS + t] = 1.0
            # layer 1, head 1: itself. Query and key: the position.
            for j in range(P):
                second.q_proj.weight[P + j, POSITION + j] = C
                second.k_proj.weight[P + j, POSITION + j] = 1.0
            for layer in (first, second):  # scores C · √P / √P: the scale cancels
                layer.q_proj.weight.mul_(math.sqrt(P))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        n = ids.shape[1]
        x = torch.cat(
            (
                nn.functional.one_hot(ids, V).float(),
                nn.functional.one_hot(torch.arange(n), P).float().expand(ids.shape[0], n, P),
                torch.zeros(ids.shape[0], n, V),
            ),
            dim=-1,
        )
        for layer in self.layers:
            x = x + layer(x, is_causal=True)
        return x


def _prompts() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(5)
    return [torch.randint(0, V, (n,), generator=generator) for n in (7, 12, 20)]


@pytest.fixture(scope="module")
def stats() -> qkv.edits.HeadStats:
    return qkv.head_stats(Heads().eval(), _prompts(), vocab_size=V, induction_length=20)


def test_the_previous_token_head(stats: qkv.edits.HeadStats) -> None:
    assert stats.values["previous"][0][0] == pytest.approx(1.0, abs=1e-6)
    assert stats.values["entropy"][0][0] < 0.2  # row 0 has one key, the others one chosen
    assert stats.values["previous"][0][1] < 0.2


def test_the_sink_head(stats: qkv.edits.HeadStats) -> None:
    assert stats.values["sink"][0][1] == pytest.approx(1.0, abs=1e-6)
    assert stats.values["sink"][0][0] < 0.2


def _expected_induction(length: int, prompts: int, seed: int) -> float:
    """The induction head's score worked out from the random tokens themselves: the query at
    position p (token x_p) spreads its attention evenly over the keys j ≤ p whose previous
    token is x_p (position 0 counts as its own previous token); one of them is p − T + 1."""
    generator = torch.Generator().manual_seed(seed)
    half = torch.randint(0, V, (prompts, length), generator=generator)
    total, rows = 0.0, 0
    for tokens in torch.cat((half, half), dim=1).tolist():
        previous = [tokens[0], *tokens[:-1]]
        for p in range(length, 2 * length):
            matches = sum(1 for j in range(p + 1) if previous[j] == tokens[p])
            total, rows = total + 1 / matches, rows + 1
    return total / rows


def test_the_induction_pair(stats: qkv.edits.HeadStats) -> None:
    expected = _expected_induction(20, 4, 0)
    assert stats.values["induction"][1][0] == pytest.approx(expected, abs=1e-6)
    assert expected > 0.5  # the head finds the token after the first occurrence
    assert max(stats.values["induction"][0]) < 0.3
    assert stats.values["induction"][1][1] < 0.1


def test_the_diagonal_head(stats: qkv.edits.HeadStats) -> None:
    assert stats.values["diagonal"][1][1] == pytest.approx(1.0, abs=1e-6)
    assert stats.values["diagonal"][0][0] < 0.2


def test_an_even_head_has_the_entropy_of_the_uniform_rows(stats: qkv.edits.HeadStats) -> None:
    """Heads 2 and 3 score every key 0: row i spreads 1/(i+1) over i + 1 keys."""
    rows = [i + 1 for n in (7, 12, 20) for i in range(n)]
    entropy = sum(math.log(k) for k in rows) / len(rows)
    sink = sum(1 / k for k in rows) / len(rows)
    for layer in (0, 1):
        assert stats.values["entropy"][layer][2] == pytest.approx(entropy, abs=1e-6)
        assert stats.values["sink"][layer][3] == pytest.approx(sink, abs=1e-6)
    assert stats.prompts == 3 and stats.tokens == 39


def test_rows_are_read_in_blocks_with_the_same_result(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("qkv.edits._stats.ROW_BUDGET", 4 * 3 * 20)  # three rows at a time
    small = qkv.head_stats(Heads().eval(), _prompts(), vocab_size=V)
    whole = qkv.head_stats(Heads().eval(), _prompts(), vocab_size=V)
    for name in qkv.edits.STATISTICS:
        for ours, theirs in zip(small.values[name], whole.values[name], strict=True):
            assert ours == pytest.approx(theirs, abs=1e-12), name


def test_without_a_vocabulary_induction_is_nan_and_texts_need_a_tokenizer() -> None:
    stats = qkv.head_stats(Heads().eval(), _prompts()[:1])
    assert all(math.isnan(v) for row in stats.values["induction"] for v in row)
    with pytest.raises(TypeError, match="text 0 is a string but no tokenizer was given"):
        qkv.head_stats(Heads().eval(), ["the cat"])
    with pytest.raises(ValueError, match="prompt 0 must be a text or token ids"):
        qkv.head_stats(Heads().eval(), [torch.zeros(3)])
