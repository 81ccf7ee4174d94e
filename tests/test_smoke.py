import numpy as np
import pytest

from shmloader import DataLoader

from .conftest import START_METHODS


class Squares:
    def __len__(self):
        return 100

    def __getitem__(self, i):
        return np.full((4, 4), i, np.float32), i


@pytest.mark.parametrize("method", START_METHODS)
def test_batches_are_views_of_the_ring(method):
    dl = DataLoader(Squares(), batch_size=10, num_workers=2, multiprocessing_context=method)
    seen = []
    for n, (x, y) in enumerate(dl):
        if n >= 2:  # the first batch of each worker sizes the ring and comes by copy
            assert not x.flags.owndata and dl.ring.contains(x) and dl.ring.contains(y)
        assert (x[:, 0, 0] == y).all()
        seen.extend(y.tolist())
    assert seen == list(range(100))
