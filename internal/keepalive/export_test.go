package keepalive

// Ticks returns how many times k's timer fired and started renewals.
func Ticks(k *Keeper) uint64 {
	k.mu.Lock()
	defer k.mu.Unlock()
	return k.ticks
}

// Queued returns how many leases wait in k's queue, and whether its timer
// is set.
func Queued(k *Keeper) (leases int, armed bool) {
	k.mu.Lock()
	defer k.mu.Unlock()
	return len(k.queue), !k.at.IsZero()
}
