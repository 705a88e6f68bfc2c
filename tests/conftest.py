"""The suite's order: the files with slow end-to-end tests (marked `slow`) first, each file whole and in
its own order (its module-scoped fixtures are built once), then the rest. With `-n 2` (the README's
command) a worker that ends on a minute-long run leaves the other idle meanwhile; started early, the
long runs overlap each other and the short tests fill the end."""


def pytest_collection_modifyitems(session, config, items):
    slow_files = {item.path for item in items if item.get_closest_marker("slow") is not None}
    items.sort(key=lambda item: item.path not in slow_files)  # a stable sort: the order within kept
