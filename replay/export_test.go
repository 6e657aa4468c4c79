package replay

var (
	Collide  = collide
	SubsetOf = subsetOf
)
