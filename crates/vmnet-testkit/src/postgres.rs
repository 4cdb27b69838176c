//! A throwaway PostgreSQL cluster for tests: unix socket only, run as the `postgres` user.
