"""The Mamba2 mixer (state-space duality) over paged recurrent state, in torch.

One layer: ``in_proj`` to ``[z | xBC | dt]``, a depthwise causal convolution of ``xBC`` (kernel
``conv_width + 1``) then SiLU, split into ``x`` (heads of ``head_dim``), ``B`` and ``C`` (``groups``
of ``state_size``), the selective scan ``h_t = exp(dt_t A) h_{t-1} + dt_t x_t B_t^T``, ``y_t = h_t
C_t + D x_t``, a gated RMS norm per group (``y * silu(z)``), ``out_proj``. Parameter names follow
transformers' ``Mamba2Mixer`` / ``BambaMixer`` / ``GraniteMoeHybridMambaLayer``.

Decodes (one token) of a step run as one batch; each prefill chunk runs the scan in pieces that
end at the step's save points (``SeqStates.saves``), each piece in the quadratic (attention-like)
form over sub-chunks of at most ``SCAN_CHUNK`` tokens. Scan and states are float32.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvos.models import ops
from kvos.models.config import MambaShape
from kvos.models.state import StateCache, StateMetadata

SCAN_CHUNK = 256
"""Longest run of tokens the quadratic form handles at once (its cost grows with its square; a
GPU runs one sub-chunk's few kernels no faster when it is shorter)."""


class GatedNormWeight(nn.Module):
    """The gated RMS norm's weight (HF name ``norm.weight``); the norm runs in ``Mamba2Mixer``."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))


class Mamba2Mixer(nn.Module):
    def __init__(self, hidden_size: int, s: MambaShape) -> None:
        super().__init__()
        self.s = s
        self.in_proj = ops.Linear(hidden_size, s.intermediate + s.conv_dim + s.num_heads, bias=s.proj_bias)
        self.conv1d = nn.Conv1d(s.conv_dim, s.conv_dim, s.conv_kernel, groups=s.conv_dim, bias=s.conv_bias)
        self.dt_bias = nn.Parameter(torch.zeros(s.num_heads))
        self.A_log = nn.Parameter(torch.zeros(s.num_heads))
        self.D = nn.Parameter(torch.ones(s.num_heads))
        self.norm = GatedNormWeight(s.intermediate)
        self.out_proj = ops.Linear(s.intermediate, hidden_size, bias=s.proj_bias)

    def forward(self, x: torch.Tensor, cache: StateCache, meta: StateMetadata) -> torch.Tensor:
        """x: ``[T, hidden]`` rows of the step (``meta``'s order); returns ``[T, hidden]``.
        Reads and writes the states ``meta`` names (see ``StateMetadata``'s safety rule)."""
        s = self.s
        z, xbc, dt_raw = self.in_proj(x).split([s.intermediate, s.conv_dim, s.num_heads], dim=-1)
        y = torch.empty(x.shape[0], s.intermediate, dtype=torch.float32, device=x.device)
        nd = meta.num_decodes
        if ops.use_kernels(x):
            from kvos.kernels.mamba_update import gated_rms_norm

            if nd:
                self._decode_kernels(xbc[:nd], dt_raw[:nd], cache, meta, y[:nd])
            if nd < x.shape[0]:  # the decode kernel applies dt's bias and softplus itself
                self._prefill_kernels(xbc, dt_raw[nd:], cache, meta, y, exact=x.dtype == torch.float32)
            return self.out_proj(gated_rms_norm(y, z, self.norm.weight, s.groups, s.norm_eps, x.dtype))
        dt, A = self._dt(dt_raw), -torch.exp(self.A_log.float())
        if nd:
            self._decode(xbc[:nd], dt[:nd], A, cache, meta, y[:nd])
        for seq in meta.seqs[nd:]:
            rows = slice(seq.row, seq.row + seq.num_tokens)
            self._prefill(xbc[rows], dt[rows], A, cache, seq, y[rows])
        return self.out_proj(self._gated_norm(y, z).to(x.dtype))

    def _dt(self, dt_raw: torch.Tensor) -> torch.Tensor:
        """The discretisation steps: ``clamp(softplus(dt_raw + dt_bias))``, float32."""
        return F.softplus(dt_raw.float() + self.dt_bias.float()).clamp(self.s.dt_min, self.s.dt_max)

    def _conv_weight(self) -> torch.Tensor:
        return self.conv1d.weight.squeeze(1)  # [conv_dim, kernel]

    def _split(self, xbc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Convolved ``[n, conv_dim]`` to x ``[n, H, P]``, B and C ``[n, H, N]`` (groups expanded), float32."""
        s = self.s
        n = xbc.shape[0]
        xs, B, C = xbc.float().split([s.intermediate, s.groups * s.state_size, s.groups * s.state_size], dim=-1)
        rep = s.num_heads // s.groups
        B = B.view(n, s.groups, s.state_size).repeat_interleave(rep, dim=1)
        C = C.view(n, s.groups, s.state_size).repeat_interleave(rep, dim=1)
        return xs.reshape(n, s.num_heads, s.head_dim), B, C

    def _decode(self, xbc, dt, A, cache: StateCache, meta: StateMetadata, y) -> None:
        """The decodes' one-token step in torch (the CPU path)."""
        nd = meta.num_decodes
        reads, keep, writes, valid = meta.decode_index(xbc.device)
        conv_in = cache.conv[reads]
        window = torch.cat([conv_in * keep, xbc.float().unsqueeze(-1)], dim=-1)  # [n, conv_dim, kernel]
        out = (window * self._conv_weight().float()).sum(-1)
        if self.conv1d.bias is not None:
            out = out + self.conv1d.bias.float()
        xs, B, C = self._split(F.silu(out))
        conv = window[:, :, 1:]
        if valid is not None:  # padding rows (CUDA graphs) write block 0's own content back
            conv = torch.where(valid[:, None, None], conv, conv_in)
        ssm_in = cache.ssm[reads]
        dA = torch.exp(dt * A) * keep.view(-1, 1)  # [n, H]; a decode with no state yet starts from zeros
        ssm = ssm_in * dA[:, :, None, None] + (dt[:, :, None] * xs)[..., None] * B[:, :, None, :]
        y.copy_((torch.einsum("nhpk,nhk->nhp", ssm, C) + self.D.float()[:, None] * xs).reshape(nd, -1))
        if valid is not None:
            ssm = torch.where(valid[:, None, None, None], ssm, ssm_in)
        writes = torch.where(valid, writes, 0) if valid is not None else writes
        cache.ssm[writes] = ssm.to(cache.ssm.dtype)
        cache.conv[writes] = conv.to(cache.conv.dtype)

    def _decode_kernels(self, xbc, dt_raw, cache: StateCache, meta: StateMetadata, y) -> None:
        """The decodes' one-token step in two kernels (``kvos.kernels.mamba_update``): the
        convolution's step, then the SSM's, reading x, B and C as views of its output."""
        from kvos.kernels.mamba_update import conv_decode, ssm_decode

        s = self.s
        nd = meta.num_decodes
        reads, keep, writes, valid = meta.decode_index(xbc.device)
        conv = conv_decode(cache.conv, reads, writes, keep, valid, xbc, self.conv1d.weight, self.conv1d.bias)
        gn = s.groups * s.state_size
        xs = conv[:, :s.intermediate].view(nd, s.num_heads, s.head_dim)
        B = conv[:, s.intermediate: s.intermediate + gn].view(nd, s.groups, s.state_size)
        C = conv[:, s.intermediate + gn:].view(nd, s.groups, s.state_size)
        ssm_decode(cache.ssm, reads, writes, keep, valid, xs, dt_raw, self.dt_bias, self.A_log, B, C, self.D,
                   (s.dt_min, s.dt_max), y.view(nd, s.num_heads, s.head_dim))

    def _conv_prefill(self, xbc: torch.Tensor, cache: StateCache, seq) -> torch.Tensor:
        """The causal convolution (then SiLU) of one sequence's new rows ``[n, conv_dim]`` from the
        inputs before them (its read block's conv state, or zeros), float32; writes the conv
        state at each of ``seq``'s save points."""
        s = self.s
        W = s.conv_width
        if seq.read_block < 0:
            prev = xbc.new_zeros(s.conv_dim, W, dtype=torch.float32)
        else:
            prev = cache.conv[seq.read_block].float()
        full = torch.cat([prev, xbc.float().t()], dim=1)  # [conv_dim, W + n]
        bias = self.conv1d.bias.float() if self.conv1d.bias is not None else None
        conv = F.conv1d(full.unsqueeze(0), self._conv_weight().float().unsqueeze(1), bias, groups=s.conv_dim)
        for b, block in seq.saves:
            cache.conv[block] = full[:, b: b + W].to(cache.conv.dtype)
        return F.silu(conv[0].t())

    def _prefill(self, xbc, dt, A, cache: StateCache, seq, y) -> None:
        """One sequence's scan in torch (the CPU path), sub-chunk by sub-chunk between its save points."""
        h = (cache.ssm[seq.read_block].float() if seq.read_block >= 0 else
             xbc.new_zeros(self.s.num_heads, self.s.head_dim, self.s.state_size, dtype=torch.float32))
        xs, B, C = self._split(self._conv_prefill(xbc, cache, seq))
        D = self.D.float()[:, None]
        a = 0
        for b, block in seq.saves:
            for lo in range(a, b, SCAN_CHUNK):
                hi = min(b, lo + SCAN_CHUNK)
                out, h = ssd_chunk(xs[lo:hi], dt[lo:hi], A, B[lo:hi], C[lo:hi], h)
                y[lo:hi] = (out + D * xs[lo:hi]).reshape(hi - lo, -1)
            a = b
            cache.ssm[block] = h.to(cache.ssm.dtype)

    def _scan_constants(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``A = -exp(A_log)``, ``D`` and ``dt_bias`` in float32, computed once and again only
        after a parameter changes in place (a weight load bumps its version): three fewer
        launches per layer and step, where short prefills are bound by the host's launches."""
        key = tuple((p.data_ptr(), p._version) for p in (self.A_log, self.D, self.dt_bias))
        if getattr(self, "_constants_key", None) != key:
            self._constants = (-torch.exp(self.A_log.detach().float()), self.D.detach().float().contiguous(),
                               self.dt_bias.detach().float().contiguous())
            self._constants_key = key
        return self._constants

    def _prefill_kernels(self, xbc, dt_raw, cache: StateCache, meta: StateMetadata, y, exact: bool) -> None:
        """Every prefill sequence of the step: one convolution and one chunked scan over all of
        them (``kvos.kernels.mamba_scan``); ``dt_raw``: the prefill rows' steps before their bias
        and softplus."""
        from kvos.kernels.mamba_scan import chunked_scan, conv_prefill, prefill_dt

        s = self.s
        nd = meta.num_decodes
        A, D, dt_bias = self._scan_constants()
        dt = prefill_dt(dt_raw, dt_bias, (s.dt_min, s.dt_max))
        conv = conv_prefill(meta.prefill_conv_rows(xbc.device), xbc[nd:], cache.conv, self.conv1d.weight,
                            self.conv1d.bias, torch.float32 if exact else torch.bfloat16)
        n, gn = conv.shape[0], s.groups * s.state_size
        xs = conv[:, :s.intermediate].view(n, s.num_heads, s.head_dim)
        B = conv[:, s.intermediate: s.intermediate + gn].view(n, s.groups, s.state_size)
        C = conv[:, s.intermediate + gn:].view(n, s.groups, s.state_size)
        chunked_scan(meta.prefill_chunks(xbc.device), xs, dt, A, B, C, D, cache.ssm,
                     y[nd:].view(n, s.num_heads, s.head_dim), exact=exact)

    def _gated_norm(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """``weight * rmsnorm_per_group(y * silu(z))`` in float32 (transformers' gated norm)."""
        s = self.s
        g = (y * F.silu(z.float())).view(y.shape[0], s.groups, -1)
        g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + s.norm_eps)
        return self.norm.weight.float() * g.view(y.shape[0], -1)


def ssd_chunk(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
              h0: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The scan over ``l`` tokens from state ``h0`` ``[H, P, N]`` in its quadratic form: x ``[l, H,
    P]``, dt ``[l, H]`` (discretisation steps), A ``[H]``, B and C ``[l, H, N]``. Returns (``y``
    without the D term, ``[l, H, P]``; the state after the last token)."""
    cs = torch.cumsum(dt * A, dim=0)  # [l, H]: log of the decay from the start to each token
    seg = cs[:, None, :] - cs[None, :, :]  # [t, s, H]: log decay from s to t
    causal = torch.ones(seg.shape[:2], dtype=torch.bool, device=seg.device).tril()
    decay = torch.exp(seg.masked_fill(~causal[..., None], float("-inf")))
    xdt = x * dt[..., None]
    scores = torch.einsum("thn,shn->tsh", C, B) * decay
    y = torch.einsum("tsh,shp->thp", scores, xdt)
    y = y + torch.exp(cs)[..., None] * torch.einsum("thn,hpn->thp", C, h0)
    to_end = torch.exp(cs[-1][None, :] - cs)  # [l, H]
    h = torch.exp(cs[-1])[:, None, None] * h0 + torch.einsum("sh,shp,shn->hpn", to_end, xdt, B)
    return y, h
