"""Count the rows of each call a packed linear's kernel runner makes."""


def count_runner_rows(monkeypatch, kernel):
    """Wrap `kernel.runner` so layers packed afterwards record each call's row count; returns the list."""
    calls = []  # the runner is resolved when a layer packs, so this must be in place before packing
    real = kernel.runner

    def counting(*args):
        run = real(*args)
        return lambda rows, *rest: calls.append(rows.shape[0]) or run(rows, *rest)

    monkeypatch.setattr(kernel, "runner", counting)
    return calls
