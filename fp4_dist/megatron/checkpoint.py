"""Checkpoint rows: the distributed optimizer's own checkpoint loads with the torch.optim fallback (no apex/TE)."""

from __future__ import annotations

import torch

def make_set_states(original):
    def _set_main_param_and_optimizer_states(self, model_param, tensors):
        # With the torch.optim fallback (no TE / apex), Adam's state holds a "step" tensor that the dp_zero
        # checkpoint does not carry (load_state_dict restores it); upstream then raises KeyError('step').
        # Keys the checkpoint lacks keep their current value.
        current = self._get_main_param_and_optimizer_states(model_param)
        missing = {k: v for k, v in current.items() if k not in tensors}
        return original(self, model_param, {**tensors, **missing} if missing else tensors)

    return _set_main_param_and_optimizer_states


def make_load_state_dict(original):
    def load_state_dict(self, state_dict):
        original(self, state_dict)
        # With the torch.optim fallback, upstream hands every param's state the *same* "step" tensor
        # (DO 1024-1031); torch's Adam increments steps in place, so one step would advance it once per
        # param and resumed runs diverge. Each state gets its own copy.
        for state in self.optimizer.state.values():
            step = state.get("step")
            if isinstance(step, torch.Tensor):
                state["step"] = step.clone()

    return load_state_dict

