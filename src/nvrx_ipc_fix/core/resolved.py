"""What NVRx resolves of a save's plan in one call of ``prepare_write_data``: the planner's
``resolve_data`` shadowed for that call, so that a fix sees each item's data as NVRx got it
(``stale_guard``: the tensors it sends; ``cpu_snapshot``: the storage each CPU tensor had)."""


def recording(planner, seen):
    """Shadow ``planner.resolve_data`` so that ``seen(item, data)`` gets each item it
    resolves, in NVRx's order; return what undoes it. ``None`` where the planner takes no
    attribute: it is left alone and ``seen`` sees nothing."""
    own = planner.__dict__.get("resolve_data") if hasattr(planner, "__dict__") else None
    resolve = planner.resolve_data

    def resolve_data(item):
        data = resolve(item)
        seen(item, data)
        return data

    try:
        planner.resolve_data = resolve_data
    except (AttributeError, TypeError):  # a planner that takes no attribute: NVRx's resolve_data
        return None

    def restore():
        try:
            if own is None:
                del planner.resolve_data
            else:
                planner.resolve_data = own
        except AttributeError:  # already gone
            pass

    return restore
