"""The job's store and the protocols on it: rendezvous and connection, the etcd store, fastdist's
keys, signed records (seal), the board (who is missing, and where), the ring (how a fault reaches
every rank), the job's records (deaths, suspects, spares), store calls bounded in time, and key
waits that close at a deadline."""
