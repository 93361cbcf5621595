"""A CPU stand-in for an EPFlow handle (EP = 1) with the binding's calling convention
(forward_train / backward_out), computing with epflow.reference: the framework integrations'
autograd plumbing tested without a GPU."""
import torch

from epflow.reference import reference_moe


class ReferenceHandle:
    def saved_context_bytes(self):
        return 16

    def id(self):
        return -1

    @staticmethod
    def _experts(t, reversed_):
        return t.flip(0) if reversed_ else t

    def forward_train(self, x, idx, w, gate, up, down, y, buffer, weights_reversed):
        g, u, d = (self._experts(t, weights_reversed) for t in (gate, up, down))
        y.copy_(reference_moe(x, idx, w, g, u, d).to(y.dtype))
        return ("context", weights_reversed)

    def backward(self, context, buffer, dy, x, idx, w, gate, up, down):
        grads = [torch.empty_like(t) for t in (x, w, gate, up, down)]
        self.backward_out(context, buffer, dy, x, idx, w, gate, up, down, *grads, False, False,
                          False)
        return tuple(grads)

    def backward_out(self, context, buffer, dy, x, idx, w, gate, up, down, dx, dw, d_gate, d_up,
                     d_down, accumulate, weights_reversed, grads_reversed):
        assert context == ("context", weights_reversed)
        with torch.enable_grad():  # (autograd runs backward() without it)
            leaves = [t.detach().float().requires_grad_(True) for t in
                      (x, w, *(self._experts(t, weights_reversed) for t in (gate, up, down)))]
            y = reference_moe(leaves[0], idx, leaves[1], *leaves[2:])
            grads = torch.autograd.grad(y, leaves, dy.float())
        dx.copy_(grads[0])
        dw.copy_(grads[1])
        for out, g in zip((d_gate, d_up, d_down), grads[2:]):
            g = self._experts(g, grads_reversed).to(out.dtype)
            out.add_(g) if accumulate else out.copy_(g)
