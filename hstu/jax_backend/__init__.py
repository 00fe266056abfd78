"""JAX backend: Flax model, shard_map collectives, balanced shuffler, Optax step, Orbax checkpoints.

The pieces are a library (see examples/jax_custom_loop.py):

* `batch`        DeviceBatch pytree (static capacities) <-> core JaggedBatch
* `collectives`  mesh, stats all_gather, allgather / all_to_all exchanges (shard_map bodies)
* `shuffler`     JaxShuffler: placement, stats gather and exchange for the core Balancer
* `model`        HSTUModel (Flax linen), params_to_flax / flax_to_params
* `attention`    reference (jnp) / kernel (Pallas) switch
* `embedding`    sharded tables (embedding.sharding): row-wise layout, all_to_all lookup,
                 touched-rows optimizer
* `state`        TrainState, the optimizer, init_state / init_sharded_state
* `train_step`   make_train_step, JaxBackend (the core trainer's Backend), run_training
* `launch`       train(cfg): devices, processes (jax.distributed), re-exec
* `checkpoint`   Orbax Checkpointer (`step-N`, keep-latest-k), TrainCheckpointer
* `convert`      this backend's half of `hstu convert`

Importing this package imports nothing heavy; import the submodules you need.
"""
