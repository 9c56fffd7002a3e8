"""CPU tests of bench.py's helpers; its timings need a GPU (python bench.py)."""
import bench


def test_kernels_beyond_takes_the_flush_out():
    """A kernel launched only by the flush (as often as alone) drops out, one that the
    row launches too (the fill) keeps the row's launches and time, and rows come most
    time per call first."""
    alone = {"fill": (20, 200.0), "flush_only": (20, 40.0)}
    both = {"fill": (40, 400.0), "flush_only": (20, 42.0), "ours": (20, 60.0), "ours_second": (40, 20.0)}
    assert bench.kernels_beyond(both, alone, calls=20) == [("fill", 1.0, 10.0), ("ours", 1.0, 3.0),
                                                            ("ours_second", 2.0, 0.5)]


def test_kernels_beyond_of_a_row_without_kernels_is_empty():
    alone = {"fill": (20, 200.0)}
    assert bench.kernels_beyond(dict(alone), alone, calls=20) == []
