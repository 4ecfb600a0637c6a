"""The fleet: hosts on many machines sharing spaces, deploys and usage through PostgreSQL."""
