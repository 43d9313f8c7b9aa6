"""Decentralized Keras 3 training on scikit-learn's handwritten digits.

    shoalrun -np 4 python examples/keras_digits.py
    shoalrun -np 4 python examples/keras_digits.py --topology exp2 --partition dirichlet --alpha 0.1

Each rank fits its own copy of a small CNN on its own shard with `model.fit`; Shoal's
callbacks do the rest: BroadcastGlobalVariablesCallback (same start), NeighborAveragingCallback
(average the weights with neighbors after every k batches: one-peer exponential schedule,
a static graph, or all ranks), ConsensusDistanceCallback (Ξ into the logs) and
MetricAverageCallback (metrics averaged over ranks). Rank 0 prints, per epoch, the mean
test accuracy of the ranks' models on a common held-out set and Ξ.
"""
import argparse
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")
try:
    import keras  # noqa: E402
except ImportError:
    raise SystemExit("examples/keras_digits.py needs TensorFlow and Keras 3: "
                     "pip install tensorflow-cpu==2.21.0") from None
import numpy as np  # noqa: E402

import shoal  # noqa: E402
import shoal.keras as sk  # noqa: E402
from digits_data import split, summary  # noqa: E402
from shoal import topology  # noqa: E402


class PrintEpoch(keras.callbacks.Callback):
    def on_epoch_begin(self, epoch, logs=None):
        self.t0 = time.perf_counter()

    def on_epoch_end(self, epoch, logs=None):
        if shoal.rank() == 0:
            print(f"epoch {epoch + 1:3d}  loss {logs['loss']:.4f}  test accuracy {100 * logs['val_accuracy']:.2f}%  "
                  f"consensus distance {logs['consensus_distance']:.3e}  {time.perf_counter() - self.t0:.1f} s",
                  flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--topology", default="one-peer-exp", choices=["one-peer-exp", "exp2", "ring", "allreduce"],
                   help="graph (or schedule) the weights are averaged over")
    p.add_argument("--partition", default="iid", choices=["iid", "dirichlet"],
                   help="how the training set is split over the ranks")
    p.add_argument("--alpha", type=float, default=0.1, help="Dirichlet concentration (smaller: more skewed)")
    p.add_argument("--every-k", type=int, default=1, help="average weights every k batches")
    p.add_argument("--epochs", type=int, default=12, help="passes over the shards")
    p.add_argument("--batch-size", type=int, default=16, help="per rank")
    p.add_argument("--lr", type=float, default=0.05, help="SGD learning rate")
    p.add_argument("--seed", type=int, default=0, help="model initialisation, split and sample order")
    args = p.parse_args()

    shoal.init()
    r, n = shoal.rank(), shoal.size()
    graphs = {"exp2": topology.exponential_two_graph, "ring": topology.ring_graph,
              "allreduce": topology.fully_connected_graph}
    if args.topology in graphs:
        shoal.set_topology(graphs[args.topology](n))
    keras.utils.set_random_seed(args.seed + r)  # different init: the broadcast makes it common
    images, labels, mine, test_idx = split(r, n, args.partition, args.alpha, args.seed)
    x = images[..., None]
    # Equal batches per epoch on every rank, so every rank averages the same number of times.
    steps = max(1, int(shoal.allreduce(np.array([len(mine) // args.batch_size], np.float64), name="steps")[0]))
    take = np.random.default_rng(args.seed + r).choice(mine, steps * args.batch_size,
                                                       replace=len(mine) < steps * args.batch_size)

    model = keras.Sequential([
        keras.Input((8, 8, 1)),
        keras.layers.Conv2D(16, 3, padding="same", activation="relu"),
        keras.layers.Conv2D(32, 3, padding="same", activation="relu"),
        keras.layers.MaxPooling2D(),
        keras.layers.Flatten(),
        keras.layers.Dense(64, activation="relu"),
        keras.layers.Dense(10),
    ])
    model.compile(optimizer=keras.optimizers.SGD(args.lr, momentum=0.9),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
    schedule = "one-peer-exp" if args.topology == "one-peer-exp" else None
    callbacks = [sk.BroadcastGlobalVariablesCallback(0),
                 sk.NeighborAveragingCallback(every_k_batches=args.every_k, schedule=schedule),
                 sk.ConsensusDistanceCallback(), sk.MetricAverageCallback(), PrintEpoch()]
    start = time.perf_counter()
    hist = model.fit(x[take], labels[take], batch_size=args.batch_size, epochs=args.epochs, shuffle=True,
                     validation_data=(x[test_idx], labels[test_idx]), callbacks=callbacks, verbose=0).history
    if r == 0:
        seconds = time.perf_counter() - start
        print(f"done in {seconds:.1f} s on {n} ranks")
        print(summary(f"topology={args.topology} every_k={args.every_k} partition={args.partition} ranks={n}",
                      args.epochs, hist["val_accuracy"][-1], hist["consensus_distance"][-1], seconds), flush=True)
    shoal.shutdown()


if __name__ == "__main__":
    main()
