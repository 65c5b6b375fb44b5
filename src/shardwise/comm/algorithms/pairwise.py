"""Pairwise-exchange all-to-all (Thakur, Rabenseifner & Gropp 2005 §4.5).

In step s = 1 … n−1, index i sends its block for i+s to i+s and receives the block of i−s from
i−s (mod n), so each step is a permutation and no rank receives from two at once. α-β cost:
(n−1)α + (n−1)/n·S·β (S: bytes of one rank's input); bytes sent by every rank: S − |its own
block| = (n−1)/n·S. Exact copies: the result is bitwise torch's. :func:`all_to_all_v` runs the
same steps on blocks of uneven sizes (MoE token dispatch): each rank sends exactly the rows it
addresses to others.
"""

from __future__ import annotations

import torch

from .p2p import Peers, wait


def all_to_all(out: torch.Tensor, x: torch.Tensor, peers: Peers) -> None:
    """Flat ``x`` [n·k] → ``out`` [n·k]: block j of ``x`` goes to index j; ``out``'s block j
    comes from index j."""
    n, i = peers.n, peers.index
    k = x.numel() // n
    out[i * k:(i + 1) * k].copy_(x[i * k:(i + 1) * k])
    sends = []
    for s in range(1, n):
        to, frm = (i + s) % n, (i - s) % n
        sends += peers.send_all(x[to * k:(to + 1) * k], to, step=s - 1)
        wait(peers.recv_all(out[frm * k:(frm + 1) * k], frm))
    wait(sends)


def all_to_all_v(out: torch.Tensor, x: torch.Tensor, peers: Peers, send_bounds: list[int],
                 recv_bounds: list[int]) -> None:
    """Uneven blocks: flat ``x``'s elements ``send_bounds[j]:send_bounds[j+1]`` go to index j;
    ``out``'s ``recv_bounds[j]:recv_bounds[j+1]`` come from index j (n + 1 offsets each; a
    block may be empty)."""
    n, i = peers.n, peers.index
    out[recv_bounds[i]:recv_bounds[i + 1]].copy_(x[send_bounds[i]:send_bounds[i + 1]])
    sends = []
    for s in range(1, n):
        to, frm = (i + s) % n, (i - s) % n
        if send_bounds[to + 1] > send_bounds[to]:
            sends += peers.send_all(x[send_bounds[to]:send_bounds[to + 1]], to, step=s - 1)
        if recv_bounds[frm + 1] > recv_bounds[frm]:
            wait(peers.recv_all(out[recv_bounds[frm]:recv_bounds[frm + 1]], frm))
    wait(sends)
