"""Membership: who is in the cluster, under a lease and an epoch. The interface (`protocol`) and
its two backends: etcd for production (`etcd`) and a registry the cluster runs itself for the
embedded `baton up` (`embedded`). A worker's side of it (register, renew, drain) is the fleet's
(`cluster.fleet.registration`). It may import `cluster.errors`, `cluster.disagg_config` and
nothing else of baton's but the engine layers."""
