"""The training step and the phase loop: phase loop, phase data, stepper, step, captured step,
micro-batch loop, optimizer, LR schedule, evaluation loop."""
