"""The ``check`` fixture's object: compares backend output with the reference, records the errors."""

from __future__ import annotations

import torch

from conformance.report import Record
from conformance.tolerances import HALF_NORM_FACTOR, ToleranceTable, dtype_name


class Check:
    def __init__(self, record: Record, table: ToleranceTable):
        self.rec, self.table = record, table

    @property
    def capability(self) -> str:
        return self.rec.capability

    @capability.setter
    def capability(self, value: str) -> None:
        self.rec.capability = value

    def close(self, actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, op: str, what: str,
              same_dtype_reference: bool = False) -> None:
        """``actual`` within the suite's (dtype, op) tolerance of ``expected`` (elementwise allclose).
        With ``same_dtype_reference`` the reference was computed in ``dtype`` itself (it already holds
        the rounding), so the aggregate bound is one rounding step: error norm <= eps(dtype) x norm."""
        tol = self.table.get(dtype, op)
        a, e = actual.detach().float().cpu(), expected.detach().float().cpu()
        assert a.shape == e.shape, f"{what}: shape {tuple(a.shape)} != reference {tuple(e.shape)}"
        diff = (a - e).abs()
        diff = torch.where(torch.isnan(diff), torch.full_like(diff, float("inf")), diff)
        max_abs = float(diff.max()) if diff.numel() else 0.0
        rel = diff / e.abs().clamp_min(max(tol.atol, 1e-6))
        max_rel = float(rel.max()) if rel.numel() else 0.0
        self.rec.update(max_abs, max_rel, str(tol))
        bad = diff > tol.atol + tol.rtol * e.abs()
        overridden = (dtype_name(dtype), op) in self.table.overrides
        factor = None if overridden else HALF_NORM_FACTOR.get(dtype_name(dtype))
        if same_dtype_reference and factor is not None and not bool(bad.any()):
            err, bound = float((a - e).norm()), torch.finfo(dtype).eps * float(e.norm())
            if err > bound:
                raise AssertionError(f"{what}: error norm {err:.3g} exceeds one {dtype_name(dtype)} rounding step of "
                                     f"the reference ({bound:.3g}) — a systematic deviation, not summation order")
            factor = None
        if factor is not None and not bool(bad.any()):
            rounding = float((e.to(dtype).float() - e).norm())
            err = float((a - e).norm())
            if err > factor * rounding + 1e-6 * float(e.norm()):
                raise AssertionError(
                    f"{what}: error norm {err:.3g} is {err / max(rounding, 1e-30):.1f}x the error of rounding the "
                    f"reference to {dtype_name(dtype)} ({rounding:.3g}); allowed {factor:g}x — a systematic "
                    f"deviation, not rounding"
                )
        if bool(bad.any()):
            first = tuple(int(i) for i in bad.nonzero()[0])
            raise AssertionError(
                f"{what}: {int(bad.sum())} of {bad.numel()} elements outside {tol} "
                f"(max abs {max_abs:.3g}, max rel {max_rel:.3g}; first at {first}: "
                f"{float(a[first]):.6g} vs reference {float(e[first]):.6g})"
            )

    def exact(self, actual: torch.Tensor, expected: torch.Tensor, op: str, what: str) -> None:
        """Bit-identical tensors (byte-moving ops); recorded against the table's exact tolerance."""
        a, e = actual.detach().cpu(), expected.detach().cpu()
        assert a.shape == e.shape, f"{what}: shape {tuple(a.shape)} != expected {tuple(e.shape)}"
        assert a.dtype == e.dtype, f"{what}: dtype {a.dtype} != expected {e.dtype}"
        tol = self.table.get(a.dtype if a.is_floating_point() else "float32", op)
        if a.is_floating_point():
            diff = (a.float() - e.float()).abs()
            max_abs = float(diff.nan_to_num(float("inf")).max()) if diff.numel() else 0.0
            rel = diff / e.float().abs().clamp_min(1e-6)
            max_rel = float(rel.nan_to_num(float("inf")).max()) if diff.numel() else 0.0
        else:
            max_abs = float((a.long() - e.long()).abs().max()) if a.numel() else 0.0
            max_rel = max_abs
        self.rec.update(max_abs, max_rel, str(tol))
        ab = a.contiguous().reshape(-1).view(torch.uint8) if a.numel() else a
        eb = e.contiguous().reshape(-1).view(torch.uint8) if e.numel() else e
        if not torch.equal(ab, eb):
            n = int((a.reshape(-1) != e.reshape(-1)).sum()) if a.numel() else 0
            raise AssertionError(
                f"{what}: not bit-identical ({n} of {a.numel()} elements differ, max abs {max_abs:.3g})"
            )

    def same_tokens(self, actual: list[list[int]], expected: list[list[int]], what: str) -> None:
        """Token sequences identical (engine level: greedy decoding has no tolerance)."""
        mism = [i for i, (x, y) in enumerate(zip(actual, expected)) if x != y]
        n_diff = sum(sum(p != q for p, q in zip(x, y)) + abs(len(x) - len(y)) for x, y in zip(actual, expected))
        self.rec.update(float(n_diff), float(n_diff), "exact (token ids)")
        assert len(actual) == len(expected), f"{what}: {len(actual)} outputs vs reference {len(expected)}"
        if mism:
            i = mism[0]
            same = min(len(actual[i]), len(expected[i]))
            pos = next((j for j, (p, q) in enumerate(zip(actual[i], expected[i])) if p != q), same)
            raise AssertionError(
                f"{what}: {len(mism)} of {len(actual)} sequences differ; sequence {i} first differs at token {pos}: "
                f"{actual[i][pos:pos + 4]} vs reference {expected[i][pos:pos + 4]}"
            )
