"""What the two NeMo RL worker doubles share: moving model, grads and optimizer with the
test's ``move_model``/``move_optimizer`` (NeMo RL's ``move_model(model, device,
move_params=..., move_grads=...)`` and its optimizer offload flags, in both workers)."""


class Moving:
    def _move(self, device, params=True, grads=True, optimizer=None):
        """``optimizer``: also move the optimizer (True), or if that flag is set (a name)."""
        self.model = self.move_model(self.model, device, move_params=params, move_grads=grads)
        if (
            optimizer
            and getattr(self, "optimizer", None) is not None
            and not self.optimizer_cpu_offload
            and (optimizer is True or getattr(self, optimizer))
        ):
            self.move_optimizer(device)
