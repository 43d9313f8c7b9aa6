"""scikit-learn's handwritten digits split for decentralized training (shared by the
torch and Keras examples): a common held-out test set and one training shard per rank."""
import numpy as np
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split


def shard(y, rank, size, partition, alpha, seed):
    """Indices of this rank's samples: iid, or class proportions ~ Dirichlet(alpha)."""
    rng = np.random.default_rng(seed)  # same on every rank: the shards are disjoint
    if partition == "iid":
        return np.array_split(rng.permutation(len(y)), size)[rank]
    mine = []
    for c in range(10):
        idx = rng.permutation(np.flatnonzero(y == c))
        cuts = (np.cumsum(rng.dirichlet([alpha] * size)) * len(idx)).astype(int)[:-1]
        mine.append(np.split(idx, cuts)[rank])
    return np.concatenate(mine)


def split(rank, size, partition="iid", alpha=0.1, seed=0):
    """(images scaled to [0, 1] of shape (1797, 8, 8) float32, labels, this rank's training
    indices, common test indices); 20% of the data, stratified, is the test set."""
    digits = load_digits()
    images = (digits.images / 16.0).astype(np.float32)
    train_idx, test_idx = train_test_split(np.arange(len(images)), test_size=0.2, random_state=0,
                                           stratify=digits.target)
    mine = train_idx[shard(digits.target[train_idx], rank, size, partition, alpha, seed)]
    return images, digits.target, mine, test_idx


def summary(setting, epochs, accuracy, consensus_distance, seconds, bytes_sent=None):
    """The last line both examples print (the tests read it): `summary: <setting> epochs=...`;
    `bytes_sent`: bytes each rank sent (mean over ranks)."""
    return (f"summary: {setting} epochs={epochs} test_accuracy={100 * accuracy:.2f}% "
            f"consensus_distance={consensus_distance:.3e} time={seconds:.1f}s"
            + ("" if bytes_sent is None else f" bytes_sent={bytes_sent:.0f}"))
