package sysfstest

import "fmt"

func addr(bus int) string { return fmt.Sprintf("0000:%02x:00.0", bus) }

func efa(chain []string, numa string, rdma, uverbs int) Function {
	return Function{Chain: chain, Vendor: "0x1d0f", Device: "0xefa2", Class: "0x020000", Driver: "efa", NUMA: numa,
		RDMA: fmt.Sprintf("rdmap%ds0", rdma), Uverbs: uverbs, NvidiaMinor: -1, NeuronIndex: -1}
}

func gpu(chain []string, numa string, minor int) Function {
	return Function{Chain: chain, Vendor: "0x10de", Device: "0x2335", Class: "0x030200", Driver: "nvidia", NUMA: numa,
		NvidiaMinor: minor, NeuronIndex: -1}
}

func neuron(chain []string, numa string, index int) Function {
	return Function{Chain: chain, Vendor: "0x1d0f", Device: "0x7364", Class: "0x088000", Driver: "neuron", NUMA: numa,
		NvidiaMinor: -1, NeuronIndex: index}
}

// switchGroup lays out one PCIe switch under its own root port: the switch's upstream
// port, then one downstream port per endpoint.
type switchGroup struct {
	root, bus int // root port bus and the switch's first bus number
	next      int
}

func (s *switchGroup) chain() []string {
	s.next++
	return []string{fmt.Sprintf("0000:%02x:01.0", s.root), addr(s.bus), fmt.Sprintf("0000:%02x:%02x.0", s.bus+1, s.next), addr(s.bus + 1 + s.next)}
}

// acceleratorMachine builds groups switches, each with accPer accelerators and nicPer
// EFAs; the first half of the switches is on NUMA node 0, the rest on node 1 (or every
// node "-1" when numa is false).
func acceleratorMachine(name string, groups, accPer, nicPer int, neuronAcc, numa bool) Fixture {
	f := Fixture{Name: name}
	acc, nic := 0, 0
	for g := range groups {
		node := "0"
		if g >= groups/2 {
			node = "1"
		}
		if !numa {
			node = "-1"
		}
		sw := &switchGroup{root: g * 0x10, bus: g*0x10 + 1}
		for range accPer {
			if neuronAcc {
				f.Functions = append(f.Functions, neuron(sw.chain(), node, acc))
			} else {
				f.Functions = append(f.Functions, gpu(sw.chain(), node, acc))
			}
			acc++
		}
		for range nicPer {
			c := sw.chain()
			f.Functions = append(f.Functions, efa(c, node, g*0x10+1+1+sw.next, nic))
			nic++
		}
	}
	return f
}

// P5en is a p5en.48xlarge: 8 H200 GPUs, each sharing a PCIe switch with 2 EFAs, 2 NUMA
// nodes — plus what discovery must ignore: two ConnectX RDMA functions (mlx5) and EC2's
// NVMe controller, which has Amazon's vendor id too.
func P5en() Fixture {
	f := acceleratorMachine("p5en", 8, 1, 2, false, true)
	f.Functions = append(f.Functions,
		Function{Chain: []string{"0000:90:01.0", "0000:91:00.0"}, Vendor: "0x15b3", Device: "0x101d", Class: "0x020700",
			Driver: "mlx5_core", NUMA: "0", RDMA: "mlx5_0", Uverbs: 16, NvidiaMinor: -1, NeuronIndex: -1},
		Function{Chain: []string{"0000:90:01.0", "0000:91:00.1"}, Vendor: "0x15b3", Device: "0x101d", Class: "0x020700",
			Driver: "mlx5_core", NUMA: "0", RDMA: "mlx5_1", Uverbs: 17, NvidiaMinor: -1, NeuronIndex: -1},
		Function{Chain: []string{"0000:a0:01.0", "0000:a1:00.0"}, Vendor: "0x1d0f", Device: "0xcd01", Class: "0x010802",
			Driver: "nvme", NUMA: "1", NvidiaMinor: -1, NeuronIndex: -1},
	)
	return f
}

// P5 is a p5.48xlarge: 8 H100 GPUs, 4 EFAs per GPU switch.
func P5() Fixture { return acceleratorMachine("p5", 8, 1, 4, false, true) }

// Trn2 is a trn2.48xlarge: 16 Neuron devices, one EFA beside each.
func Trn2() Fixture { return acceleratorMachine("trn2", 16, 1, 1, true, true) }

// Trn1 is a trn1.32xlarge: 16 Neuron devices, one EFA per pair of them.
func Trn1() Fixture { return acceleratorMachine("trn1", 8, 2, 1, true, true) }

// VM is a p5en-shaped machine whose platform reports no NUMA (numa_node -1).
func VM() Fixture {
	f := acceleratorMachine("vm", 8, 1, 2, false, false)
	f.Name = "vm"
	return f
}

// Broken is a p5en whose sysfs is damaged in the ways real nodes are: a function
// without a vendor file, a dangling driver link, an unreadable numa_node, and an EFA
// whose port is down.
func Broken() Fixture {
	f := P5en()
	f.Name = "broken"
	f.Functions[0].Vendor = ""           // GPU 0: no vendor file
	f.Functions[1].Driver = "dangling-x" // EFA next to GPU 0: dangling driver link
	f.Functions[3].NUMA = "garbage"      // GPU 1: numa_node is not a number
	f.Functions[4].PortState = "1: DOWN" // EFA next to GPU 1: port down
	return f
}

// All are the fixtures by name.
func All() map[string]Fixture {
	out := map[string]Fixture{}
	for _, f := range []Fixture{P5en(), P5(), Trn2(), Trn1(), VM(), Broken()} {
		out[f.Name] = f
	}
	return out
}
