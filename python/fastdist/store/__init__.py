"""The job's store: rendezvous and connection, the etcd store, fastdist's keys, store calls
bounded in time, and key waits that close at a deadline."""
